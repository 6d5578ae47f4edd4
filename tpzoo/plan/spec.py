"""What the plan advisor is asked about: the cluster, the training run, and one parallel layout.

Rank placement follows tpzoo.parallel.state (Megatron's order, tp fastest, then cp, then dp, then pp), so
with K GPUs per node the tp group is K/tp-aligned consecutive ranks and tp must divide K: a tensor-parallel
group never crosses a node (its collectives sit on the critical path of every layer). Context parallelism (cp):
each cp rank holds seq_len / cp tokens of every sequence (the plan asks for whole load-balanced chunks, a
multiple of 2 * cp, times tp under sequence parallelism); the gradients are reduced over dp x cp.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tpzoo.models.config import ModelConfig
from tpzoo.parallel.dims import ParallelLayoutError

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved", "zb", "gpipe")
KERNELS = ("fused", "reference")
OPTIMIZERS = ("adamw", "muon")  # TrainConfig's --optimizer choices
FP8_RECIPES = ("none", "tensorwise", "rowwise")  # tpzoo.parallel.fp8.FP8_RECIPES (a test keeps them equal)


@dataclass(frozen=True)
class ClusterSpec:
    """The machine. Defaults describe an H100 SXM DGX: 989 dense bf16 TFLOP/s, NVLink ~450 GB/s per direction,
    one 400 Gb/s InfiniBand NIC (~50 GB/s) per GPU, 3.35 TB/s HBM."""
    gpus: int
    gpu_memory_gib: float = 80.0
    gpus_per_node: int = 8
    gpu_tflops: float = 989.0          # dense peak of the training dtype
    intra_node_gbps: float = 450.0     # GB/s per GPU per direction (NVLink)
    inter_node_gbps: float = 50.0      # GB/s per GPU per direction (one NIC per GPU)
    hbm_gbps: float = 3350.0           # for the memory-bound optimizer step
    efficiency: float = 0.6            # achieved fraction of peak on tpzoo's matmuls + attention (see docs/plan.md)
    latency_us: float = 20.0           # fixed cost of one collective or send (launch + synchronization)
    reserve_gib: float = 3.0           # CUDA context, NCCL buffers, cuBLAS/attention workspaces, fragmentation

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError("gpus and gpus_per_node must be positive")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}")


@dataclass(frozen=True)
class TrainingSpec:
    """The run. Mixed precision as tpzoo trains (see docs/plan.md): parameters and activations in `dtype`;
    fp32 gradients (main grads, reduced in fp32), fp32 master weights when dtype is 16-bit, AdamW's two fp32
    moments. `kernels`: "fused" = the Triton kernels (what runs on CUDA), "reference" = the torch references
    (what runs on CPU); they save different tensors for the backward."""
    seq_len: int
    global_batch_size: int             # sequences per optimizer step
    dtype: str = "bf16"
    zero1: bool = False                # alias of zero=1
    vocab_padding_multiple: int = 1    # as Transformer(vocab_padding_multiple=...); the vocab pads to tp * this
    kernels: str = "fused"
    lora_rank: int = 0                 # > 0: LoRA on every linear layer of a frozen base (tpzoo.plan.lora)
    lora_experts: bool = False         # and on every routed expert of a mixture of experts (--lora-experts)
    base_dtype: str | None = None      # "fp8" / "int4": that frozen base kept quantized (tpzoo.plan.quant)
    zero: int = 0                      # 1: master + AdamW moments sharded over dp (Megatron distributed
                                       # optimizer); 2: the fp32 gradients too (reduce-scattered per micro-batch);
                                       # 3: the weights too (each layer all-gathered when used)
    overlap_grad_reduce: bool = True   # gradient buckets reduce during the backward passes
    grad_bucket_elems: int = 1 << 24   # DistributedAdamW's bucket (elements)
    fused_linear_cross_entropy: bool = True  # the head and the loss in token chunks (tpzoo's default; plan/head.py)
    fp8: str = "none"                  # "tensorwise" / "rowwise": the projections' GEMMs in FP8 (plan/fp8.py)
    grad_accumulation_fusion: bool = True  # weight gradients accumulated into the fp32 main grads by the matmul
    compile: bool = False              # regional torch.compile of the blocks (`--compile`): a block's saved tensors
                                       # counted as the fused kernels' (inductor fuses the references the same way)
    frozen: tuple = field(default=(), hash=False)  # ModelConfigs of frozen models held beside the trained one at
                                       # its layout, in `dtype`: DPO's reference copy, a distillation teacher
                                       # (tpzoo.post; plan/post.py)
    optimizer: str = "adamw"           # "muon": Muon for the hidden layers' matrices (plan/muon.py)
    muon_ns_steps: int = 5             # its Newton-Schulz iterations

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.lora_rank < 0:
            raise ValueError(f"lora rank must be >= 0, got {self.lora_rank}")
        if self.zero_level not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8 must be one of {', '.join(FP8_RECIPES)}, got {self.fp8!r}")
        if self.zero_level == 3 and self.compile:
            raise ValueError("--compile with --zero 3 is not supported (the per-layer gathers are not composed with "
                             "compilation): use --zero 2")
        if self.base_dtype is not None and (self.base_dtype not in ("fp8", "int4") or not self.lora_rank):
            raise ValueError(f"base dtype {self.base_dtype!r}: fp8 or int4, for a LoRA run's frozen base (--lora-rank)")
        if self.lora_experts and not self.lora_rank:
            raise ValueError("--lora-experts adapts the routed experts in a LoRA run: give --lora-rank R")
        if self.zero_level == 3 and self.lora_rank:
            raise ValueError("ZeRO-3 with LoRA is not supported (the frozen base is not sharded): use --zero 2")

    @property
    def zero_level(self) -> int:
        return max(self.zero, 1 if self.zero1 else 0)

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Layout:
    """One parallel layout: tp * pp * dp GPUs, micro-batches of `micro_batch_size` sequences."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    schedule: str = "1f1b"             # ignored when pp == 1
    virtual_stages: int = 1            # > 1 only with the interleaved schedule
    cp: int = 1                        # context parallel (ring attention)
    ep: int = 1                        # expert parallel (MoE): carved out of dp x cp, ep divides dp * cp
    boundaries: tuple | None = None    # the pp * v model stages' first layers and the end (`--pp-boundaries`);
                                       # None: tpzoo.pipeline.partition_layers' cost-balanced default

    @property
    def expert_replicas(self) -> int:
        """Ranks that hold the same experts and reduce their gradients (edp): dp x cp / ep."""
        return self.dp * self.cp // self.ep

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def grad_replicas(self) -> int:
        """Ranks that hold the same parameters and reduce their gradients: dp x cp."""
        return self.dp * self.cp

    def label(self) -> str:
        sched = "-" if self.pp == 1 else (f"interleaved(v={self.virtual_stages})" if self.schedule == "interleaved"
                                          else self.schedule)
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        cuts = f" boundaries={','.join(map(str, self.boundaries))}" if self.boundaries else ""
        return (f"tp={self.tp}{cp} pp={self.pp} dp={self.dp}{ep} mbs={self.micro_batch_size} rec={self.recompute} "
                f"sp={'on' if self.sequence_parallel else 'off'} sched={sched}{cuts}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if self.ep == 1:  # dense layouts print what they always did
            del d["ep"]
        if self.boundaries is None:
            del d["boundaries"]
        else:
            d["boundaries"] = list(self.boundaries)
        return d

    def replace(self, **changes) -> "Layout":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class RankLayout:
    """What one rank's share of a layer depends on (the argument of the per-kind costs, plan/kinds): how the layer is
    split (tp, sequence parallelism, cp, ep), what is recomputed, and in which precision and kernels."""
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    ep: int = 1
    recompute: str = "none"
    act_bytes: int = 2                 # e: bytes of an activation element (the model dtype)
    kernels: str = "fused"             # "fused" (Triton, CUDA) | "reference" (torch, CPU)
    vocab_padding_multiple: int = 1

    @classmethod
    def of(cls, layout: "Layout", training: "TrainingSpec | None" = None) -> "RankLayout":
        t = training or TrainingSpec(seq_len=1, global_batch_size=1)
        kernels = "fused" if t.compile else t.kernels  # inductor fuses the compiled blocks as the kernels do
        return cls(layout.tp, layout.sequence_parallel, layout.cp, layout.ep, layout.recompute, t.act_bytes,
                   kernels, t.vocab_padding_multiple)

    @property
    def sp_div(self) -> int:
        """How many ranks share a token's activations outside the TP region (tp under SP, else 1)."""
        return self.tp if self.sequence_parallel else 1

    def replace(self, **changes) -> "RankLayout":
        return dataclasses.replace(self, **changes)


def num_micro_batches(layout: Layout, training: TrainingSpec) -> int:
    return training.global_batch_size // (layout.dp * layout.micro_batch_size)


def local_seq_len(layout: Layout, training: TrainingSpec) -> int:
    """Tokens of each sequence on one cp rank."""
    return training.seq_len // layout.cp


def check_layout(cfg: ModelConfig, layout: Layout, cluster: ClusterSpec, training: TrainingSpec) -> None:
    """Raise ParallelLayoutError (naming the numbers) for a layout tpzoo cannot run or the advisor forbids."""
    t, p, d, c = layout.tp, layout.pp, layout.dp, layout.cp
    if layout.gpus != cluster.gpus:
        raise ParallelLayoutError(f"tp*pp*dp = {t}*{p}*{d} = {layout.gpus} != {cluster.gpus} GPUs" if c == 1 else
                                  f"tp*cp*pp*dp = {t}*{c}*{p}*{d} = {layout.gpus} != {cluster.gpus} GPUs")
    unit = 2 * c * (t if layout.sequence_parallel else 1)
    if c > 1 and training.seq_len % unit:
        raise ParallelLayoutError(f"cp={c}: seq_len={training.seq_len} is not a multiple of 2*cp"
                                  f"{'*tp' if layout.sequence_parallel else ''} = {unit} (whole chunks)")
    if t > cluster.gpus_per_node or cluster.gpus_per_node % t:
        raise ParallelLayoutError(f"tp={t} must divide the {cluster.gpus_per_node} GPUs of a node (no tp across nodes)")
    from .layers import check_kinds  # every layer kind says whether it splits (plan/kinds)

    check_kinds(cfg, RankLayout.of(layout, training))
    if p * layout.virtual_stages > cfg.num_layers:
        raise ParallelLayoutError(f"pp*v = {p}*{layout.virtual_stages} > num_layers={cfg.num_layers}: "
                                  "a pipeline stage would hold no layer")
    if layout.boundaries is not None:
        from tpzoo.pipeline.partition import PartitionError

        try:
            chunk_layer_ranges(cfg, layout)
        except PartitionError as exc:
            raise ParallelLayoutError(str(exc)) from None
    if training.global_batch_size % (d * layout.micro_batch_size):
        raise ParallelLayoutError(f"global batch {training.global_batch_size} is not divisible by "
                                  f"dp*mbs = {d}*{layout.micro_batch_size}")
    check_experts(cfg, layout, training)
    from .quant import check_base  # a quantized base splits along whole blocks

    check_base(cfg, t, layout.ep, training.base_dtype)
    if layout.recompute not in RECOMPUTE:
        raise ParallelLayoutError(f"recompute must be one of {RECOMPUTE}")
    if layout.sequence_parallel and (t == 1 or training.seq_len % t):
        raise ParallelLayoutError(f"sequence parallelism needs tp > 1 dividing seq_len={training.seq_len}")
    if layout.schedule not in SCHEDULES:
        raise ParallelLayoutError(f"schedule must be one of {SCHEDULES}")
    v = layout.virtual_stages
    if v != 1 and (layout.schedule != "interleaved" or p == 1):
        raise ParallelLayoutError("virtual_stages > 1 needs the interleaved schedule and pp > 1")
    if layout.schedule == "interleaved" and p > 1:
        m = num_micro_batches(layout, training)
        if v < 2:  # uneven chunks are fine: tpzoo.pipeline.partition_layers balances them by parameters
            raise ParallelLayoutError(f"interleaved: virtual_stages must be >= 2, got {v}")
        if m % p:  # Megatron's interleaved schedule runs micro-batches in groups of pp
            raise ParallelLayoutError(f"interleaved: {m} micro-batches are not a multiple of pp={p}")


def check_experts(cfg: ModelConfig, layout: Layout, training: TrainingSpec) -> None:
    """Expert parallelism as tpzoo trains it (tpzoo/train/preflight.py check_experts, TrainConfig): ep divides
    the experts (the MoE kind's check) and dp x cp; no ZeRO-3 with ep > 1; MoE at cp > 1 is trained but not planned
    yet."""
    from .layers import has_experts

    ep = layout.ep
    experts = has_experts(cfg)
    if ep > 1 and not experts:
        raise ParallelLayoutError(f"ep={ep} needs a mixture-of-experts model (this one has no experts)")
    if not experts:
        return
    if layout.grad_replicas % ep:
        raise ParallelLayoutError(f"ep={ep} does not divide dp*cp = {layout.grad_replicas}")
    if ep > 1 and training.zero_level >= 3:
        raise ParallelLayoutError(f"ZeRO-3 with ep={ep} is not supported by the trainer (use --zero 2 or ep=1)")
    if layout.cp > 1:
        raise ParallelLayoutError(f"cp={layout.cp} with a mixture-of-experts model is not planned yet (the trainer "
                                  "runs it; the plan's MoE model is for cp=1)")


def chunk_layer_ranges(cfg: ModelConfig, layout: Layout) -> tuple[tuple[int, int], ...]:
    """Layer ranges of the pp * v model stages in model order, exactly as tpzoo.pipeline.partition_layers splits
    them: layout.boundaries, or the default (balanced by each layer's cost: tpzoo/pipeline/partition.py). Model
    stage c * pp + r is chunk c of pipeline rank r."""
    from tpzoo.pipeline import partition_layers

    from .layers import memo

    key = ("ranges", layout.pp, layout.virtual_stages, layout.boundaries)
    return memo(cfg, key, lambda: tuple(partition_layers(cfg, layout.pp, list(layout.boundaries)
                                                         if layout.boundaries is not None else None,
                                                         virtual_stages=layout.virtual_stages)))


def stage_chunks(cfg: ModelConfig, layout: Layout, stage: int) -> tuple[tuple[int, int], ...]:
    """Layer ranges of the chunks pipeline rank `stage` holds (chunk c = model stage c * pp + stage)."""
    return chunk_layer_ranges(cfg, layout)[stage::layout.pp]


def stage_layers(cfg: ModelConfig, layout: Layout, stage: int) -> int:
    return sum(b - a for a, b in stage_chunks(cfg, layout, stage))


def group_is_intra_node(stride: int, size: int, gpus_per_node: int) -> bool:
    """Whether every group of `size` ranks spaced `stride` apart (stride * size consecutive ranks, aligned)
    lies within one node."""
    span = stride * size
    return size == 1 or (span <= gpus_per_node and gpus_per_node % span == 0)
