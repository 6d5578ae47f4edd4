"""Per-GPU memory of a tpzoo training layout: parameters, gradients, optimizer states, activations.

Each layer is what its kinds say it is (plan/layers.py: the block's norms plus the token and channel mixer's
costs, plan/kinds), at one rank's layout (spec.RankLayout); this module adds the embedding, the head, the
pipeline's in-flight micro-batches and the training state. Parameters are counted exactly as
tpzoo.models.Transformer builds a rank's part (tested against the real model): vocab padded to tp * multiple, a
tied embedding held twice (first and last stage) when pp > 1, each kind's own split (attention: kv heads
replicated when kv_heads < tp; norms and row-parallel biases replicated).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
re-derived for what tpzoo's code saves for the backward (tested against live storages on CPU). Per layer and
token, with e = activation bytes, d = tp under sequence parallelism else 1: its norms, 2 * norm_saved / d
(fused: e*h + 4 (rms) / + 8 (layer norm); torch rms: 4h + e*h + 4), and what each kind keeps (plan/kinds: for
attention and the MLP their column layers' inputs as this rank's shard, the attention buffers, the MLP's
intermediates; flash attention never materializes the s^2 scores, so the paper's 5as/h term is absent).
Selective recompute (tpzoo checkpoints the attention core) drops just the log-sum-exp. Full recompute keeps each
layer's input, e*h/d per token (the paper's 2sbh), and what a kind keeps beyond it (a router's statistics). How
many micro-batches a stage holds comes from replaying tpzoo's schedule (plan/schedule.py).

Training state, as tpzoo.train.optim.DistributedAdamW allocates it (tested against it): one flat parameter
buffer in the model dtype padded to a multiple of dp (P elements); the fp32 main-gradient buffer (P) that every
micro-batch's gradients are added into as autograd produces them (Megatron's main_grad: no 16-bit .grad is kept);
fp32 master (16-bit models), exp_avg and exp_avg_sq over the owned range (P, or P/dp under ZeRO-1); under ZeRO-1
with dp > 1 the reduce-scattered fp32 gradient shard (P/dp). So 18 bytes per element in bf16 without ZeRO-1
(Megatron's figure), 16 in fp32. Under context parallelism "dp" here is dp x cp (the ranks that hold the same
parameters), and every activation term counts the seq_len / cp tokens of a cp rank (ring attention keeps what
SDPA keeps: q, k, v, its output and the log-sum-exp).
Mixtures of experts (docs/plan.md): at ep > 1 the expert weights have their own optimizer over edp = dp x cp / ep
(expert_state_bytes).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tpzoo.models.config import ModelConfig

from .head import head_activation_bytes, head_output_grad_bytes, head_transient_bytes, local_vocab
from .layers import layer_activation_bytes, layer_cost, memo, norm_saved, rotary_tables_bytes
from .lora import lora_chunk_activation_delta, lora_layer_expert_params, lora_layer_late, lora_layer_params
from .quant import base_bytes
from .schedule import held_states, peak_bytes
from .spec import DTYPE_BYTES, Layout, RankLayout, TrainingSpec, local_seq_len, num_micro_batches, stage_chunks


# -- parameters ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamCount:
    numel: int              # elements of this rank's parameters (a shared tied weight once)
    tensors: int            # parameter tensors
    matmul: int             # elements of the layers' matmul weights a token goes through (FLOPs per token = 2 *
                            # this, forward; replicated down projections and routers counted whole)
    sequence_parallel: int  # replicated elements whose gradient is partial (summed over tp): under SP, or always
    replicated_kv: int      # elements of tensors holding replicated kv heads (gradients summed over tp)
    embedding: int          # elements of a tied embedding/head copy kept in sync over the embedding group
    expert: int = 0         # elements of expert weights (MoE): at ep > 1 in their own optimizer, over edp
    partial: int = 0        # of sequence_parallel: the elements partial at any layout (per-head norms)


def layer_params(cfg: ModelConfig, layer: int, at: RankLayout) -> ParamCount:
    """Layer `layer` on one tp rank (of its ep group) at `at`: its block's norms and its kinds' weights
    (plan/kinds)."""
    c = layer_cost(cfg, layer, at)
    w = c.weights
    return ParamCount(w.numel, w.tensors, c.matmul_elements(), w.partial_sp + w.partial, w.replicated, 0, w.expert,
                      w.partial)


def stage_layer_ids(cfg: ModelConfig, layout: Layout, stage: int) -> list[int]:
    """The layers pipeline rank `stage` holds (all its model chunks): on the last stage, multi-token prediction's
    blocks too (layers num_layers and on, beside the head: models/mtp.py)."""
    ids = [i for lo, hi in stage_chunks(cfg, layout, stage) for i in range(lo, hi)]
    return ids + (mtp_layer_ids(cfg) if stage == layout.pp - 1 else [])


def mtp_layer_ids(cfg: ModelConfig) -> list[int]:
    return list(range(cfg.num_layers, cfg.num_layers + cfg.mtp_depths))


def mtp_extra_params(cfg: ModelConfig, tp: int) -> tuple[int, int, int]:
    """(elements, tensors, replicated norm elements) of the depths' own parts beside their blocks: enorm, hnorm and
    the final norm (replicated), eh_proj (2h -> h, column-parallel)."""
    h, d = cfg.hidden_size, cfg.mtp_depths
    norm, norm_tensors = h * (2 if cfg.norm == "layernorm" else 1), 2 if cfg.norm == "layernorm" else 1
    return d * (3 * norm + 2 * h * h // tp), d * (3 * norm_tensors + 1), d * 3 * norm


def stage_params(cfg: ModelConfig, layout: Layout, stage: int, vocab_padding_multiple: int = 1) -> ParamCount:
    """Exactly the parameters of pipeline stage `stage` on one tp rank (all its model chunks) at `layout`'s tp, pp,
    virtual stages, ep and pipeline boundaries (computed once per those: every variant of a layout shares them)."""
    key = ("stage_params", layout.tp, layout.pp, layout.virtual_stages, layout.ep, layout.boundaries, stage,
           vocab_padding_multiple)
    return memo(cfg, key, lambda: _stage_params(cfg, layout, stage, vocab_padding_multiple))


def _stage_params(cfg: ModelConfig, layout: Layout, stage: int, vocab_padding_multiple: int) -> ParamCount:
    h, p, at = cfg.hidden_size, layout.pp, RankLayout(tp=layout.tp, ep=layout.ep)
    counts = [layer_params(cfg, i, at) for i in stage_layer_ids(cfg, layout, stage)]
    numel, tensors, sp, matmul, replicated, expert, partial = (
        sum(getattr(c, f) for c in counts) for f in ("numel", "tensors", "sequence_parallel", "matmul",
                                                     "replicated_kv", "expert", "partial"))
    table = local_vocab(cfg, layout.tp, vocab_padding_multiple) * h
    first, last = stage == 0, stage == p - 1
    embedding = 0
    if first:
        numel, tensors = numel + table, tensors + 1
        if cfg.position == "learned":
            numel, tensors, sp = (numel + cfg.max_position_embeddings * h, tensors + 1,
                                  sp + cfg.max_position_embeddings * h)
    if last:
        norm = h * (2 if cfg.norm == "layernorm" else 1)
        numel, tensors, sp = numel + norm, tensors + (2 if cfg.norm == "layernorm" else 1), sp + norm
        if not (cfg.tie_embeddings and first):  # tied on one stage: the head is the embedding itself
            numel, tensors = numel + table, tensors + 1
        if cfg.mtp is not None:  # the depths' norms and projections; on a stage without the embedding, their copy
            extra, extra_tensors, extra_sp = mtp_extra_params(cfg, layout.tp)  # of it (the tied head itself)
            numel, tensors, sp = numel + extra, tensors + extra_tensors, sp + extra_sp
            matmul += extra - extra_sp
            if not first and not cfg.tie_embeddings:
                numel, tensors = numel + table, tensors + 1
    if (cfg.tie_embeddings or cfg.mtp is not None) and p > 1 and (first or last):
        embedding = table
    return ParamCount(numel, tensors, matmul, sp, replicated, embedding, expert, partial)


@dataclass(frozen=True)
class StateBytes:
    params: int       # the flat parameter buffer (model dtype, padded)
    grads: int        # fp32 main gradients (+ the reduce-scattered shard under ZeRO-1; ZeRO-2: shard + late buckets)
    master: int       # fp32 master weights of the owned range (16-bit models)
    optimizer: int    # exp_avg + exp_avg_sq of the owned range


def late_params(count: ParamCount, tp: int, sequence_parallel: bool) -> int:
    """Elements DistributedAdamW lays out last, reduced after finalize_grads (tpzoo.parallel.data_parallel):
    replicated parameters with a partial gradient (tp > 1: under SP all of them, else the per-head norms),
    replicated kv heads, a tied embedding copy (pp > 1)."""
    partial = (count.sequence_parallel if sequence_parallel else count.partial) if tp > 1 else 0
    return partial + count.replicated_kv + count.embedding


def bucket_size(training: TrainingSpec, dp: int) -> int:
    return -(-training.grad_bucket_elems // dp) * dp


def state_bytes(count: ParamCount, training: TrainingSpec, dp: int = 1, late: int = 0,
                resident: int = 0) -> StateBytes:
    """Bytes of one rank's training state under DistributedAdamW (what its `buffer_bytes()` reports): the flat
    weight buffer (model dtype, padded to a multiple of dp); gradients: the fp32 main-gradient buffer that
    micro-batches accumulate into (no 16-bit .grad is kept), plus the reduce-scattered shard under ZeRO-1; under
    ZeRO-2 only the fp32 shard (1/dp of every bucket) and full storage for the buckets from the first one holding
    one of the `late` elements (late_params) on; a separate fp32 master of the owned range (none for fp32
    weights); AdamW's two fp32 moments of the owned range. The global-norm bookkeeping keeps no per-element
    state, so tp rank and a tied head copy change nothing else here.
    ZeRO-3 (tpzoo.parallel.param_shards) keeps of the weights only the owned shard, the late buckets in full (as
    ZeRO-2 keeps their gradients) and `resident` elements (buckets of a weight two layers share: a tied embedding
    and head on one stage, `resident_params`); the layers gathered for use are `gathered_bytes`."""
    n, e, zero = count.numel, DTYPE_BYTES[training.dtype], training.zero_level
    padded = -(-max(n, 1) // dp) * dp
    shard = padded // dp
    owned = shard if zero else padded
    late_full = padded
    if zero >= 2:
        size = bucket_size(training, dp)
        late_start = (n - late) // size * size if late else padded
        late_full = padded - late_start
        grads = 4 * shard + 4 * late_full
    else:
        grads = 4 * padded + (4 * shard if zero and dp > 1 else 0)
    weights = e * (shard + late_full + resident) if zero >= 3 else e * padded
    return StateBytes(weights, grads, 4 * owned if e < 4 else 0, 8 * owned)


def expert_state_bytes(count: ParamCount, training: TrainingSpec, replicas: int, ep: int, late: int = 0,
                       resident: int = 0) -> StateBytes:
    """state_bytes of a rank with expert weights at expert parallelism `ep` (tpzoo/train/expert_optim.py): at
    ep > 1 two DistributedAdamW, the dense weights over dp x cp (`replicas`, with the late elements) and the
    expert weights over edp = replicas / ep (no late ones: neither replicated over tp nor partial under SP); at
    ep = 1 one optimizer over everything (state_bytes). ZeRO-3 with ep > 1 is refused by the trainer."""
    if ep == 1 or not count.expert:
        return state_bytes(count, training, replicas, late, resident)
    dense = state_bytes(ParamCount(count.numel - count.expert, 0, 0, 0, 0, 0), training, replicas, late, resident)
    experts = state_bytes(ParamCount(count.expert, 0, 0, 0, 0, 0), training, replicas // ep)
    return StateBytes(*(a + b for a, b in zip(dataclasses.astuple(dense), dataclasses.astuple(experts))))


def _in_buckets(elems: int, size: int, padded: int) -> int:
    """Elements of the whole buckets a run of `elems` elements touches (at most two more than its own)."""
    return min(padded, (-(-elems // size) + 1) * size)


def resident_params(cfg: ModelConfig, count: ParamCount, training: TrainingSpec, tp: int, dp: int,
                    first: bool, last: bool) -> int:
    """ZeRO-3: elements kept gathered besides the late buckets: the buckets of a tied embedding that is also this
    stage's head (pp = 1: first and last; with pp > 1 the copies are late). Laid out first, so from bucket 0."""
    if training.zero_level < 3 or not (cfg.tie_embeddings and first and last):
        return 0
    padded = -(-max(count.numel, 1) // dp) * dp
    table = local_vocab(cfg, tp, training.vocab_padding_multiple) * cfg.hidden_size
    return min(padded, -(-table // bucket_size(training, dp)) * bucket_size(training, dp))


def gathered_bytes(cfg: ModelConfig, count: ParamCount, training: TrainingSpec, tp: int, dp: int,
                   layers: list[int] | None = None) -> int:
    """ZeRO-3's gathered working set: at most three layers' buffers at once (the one in use, the next one
    prefetched, one whose backward just ended), each the whole buckets its weights touch; the largest layer is one
    of `layers` (default: every layer) or the (untied) embedding table or head."""
    if training.zero_level < 3:
        return 0
    padded = -(-max(count.numel, 1) // dp) * dp
    table = local_vocab(cfg, tp, training.vocab_padding_multiple) * cfg.hidden_size
    at = RankLayout(tp=tp)  # ZeRO-3: ep = 1
    ids = range(cfg.num_layers) if layers is None else layers
    largest = max([layer_params(cfg, i, at).numel for i in ids] + [table])
    return 3 * DTYPE_BYTES[training.dtype] * _in_buckets(largest, bucket_size(training, dp), padded)


def state_bytes_per_param(training: TrainingSpec) -> str:
    """What one parameter costs in training state (weights, fp32 main grads, master, AdamW moments), as `tpzoo
    plan` prints it: "18 B/param" in bf16, "6 + 16/dp B/param" in bf16 with ZeRO-1, "18/dp B/param" with ZeRO-3
    (derived from state_bytes)."""
    n = 1 << 20

    def per_param(dp: int) -> float:
        b = state_bytes(ParamCount(n, 0, 0, 0, 0, 0), training, dp)
        return (b.params + b.grads + b.master + b.optimizer) / n

    if not training.zero_level:
        return f"{per_param(1):g} B/param"
    sharded = 4 * (per_param(2) - per_param(4))
    whole = per_param(2) - sharded / 2
    return f"{whole:g} + {sharded:g}/dp B/param" if whole else f"{sharded:g}/dp B/param"  # ZeRO-3: all sharded


# -- activations --------------------------------------------------------------------------------------------
def chunk_activation_bytes(cfg: ModelConfig, at: RankLayout, layers, micro_batch: int, seq_len: int, first: bool,
                           last: bool, lora_rank: int = 0, fused_loss: bool = True,
                           lora_experts: bool = False) -> dict:
    """Bytes a model chunk (one tpzoo Transformer) holding `layers` (layer ids, e.g. a range) keeps for one
    micro-batch of micro_batch x seq_len tokens (seq_len of this cp rank), by part: layers, rope (the cos/sin tables
    its layers share), embedding (lookup indices), head (final norm, head and loss on the last model stage, fused_loss
    or not: plan/head.py; elsewhere the output the pipeline engine keeps for the backward)."""
    layers = list(layers)
    h, tokens, e, sp_div = cfg.hidden_size, micro_batch * seq_len, at.act_bytes, at.sp_div
    parts = {"layers": sum(layer_activation_bytes(cfg, i, at, micro_batch, seq_len) for i in layers)}
    parts["rope"] = rotary_tables_bytes(cfg, layers, seq_len)
    embed = 9 * tokens if (first and at.tp > 1) else 0  # local ids (int64) + out-of-shard mask of the vocab split
    if first and cfg.position == "learned":
        embed += 8 * seq_len  # the position ids the position embedding saves
    parts["embedding"] = embed
    if last:  # final norm, head and loss (plan/head.py)
        parts["head"] = head_activation_bytes(cfg, at, tokens, fused_loss, norm_saved(cfg, e, at.kernels))
        if cfg.mtp is not None:  # multi-token prediction's depths: their blocks, and each its norms, projection
            # input and head (models/mtp.py)
            parts["mtp"] = sum(layer_activation_bytes(cfg, i, at, micro_batch, seq_len) for i in mtp_layer_ids(cfg))
            parts["mtp"] += cfg.mtp_depths * (head_activation_bytes(cfg, at, tokens, fused_loss,
                                                                    norm_saved(cfg, e, at.kernels))
                                              + (2 * norm_saved(cfg, e, at.kernels) + 2 * e * h) * tokens // sp_div)
    else:
        parts["head"] = e * h * tokens // sp_div  # the stage output, kept for its backward
    # The engine keeps a received input for its gradient; only the torch RMSNorm does not save it anyway (it
    # saves an fp32 copy), and under full recompute it is already counted as the checkpoint's input.
    keeps_input = cfg.norm == "rmsnorm" and at.kernels == "reference" and at.recompute != "full"
    parts["input"] = e * h * tokens // sp_div if (not first and layers and keeps_input) else 0
    if lora_rank:  # a frozen base with adapters (tpzoo.plan.lora)
        parts["lora"] = lora_chunk_activation_delta(cfg, at, lora_rank, layers, micro_batch, seq_len, first, last,
                                                    norm_saved(cfg, e, at.kernels), fused_loss, lora_experts)
    return parts


def output_grad_bytes(cfg: ModelConfig, at: RankLayout, micro_batch: int, seq_len: int, last: bool,
                      fused_loss: bool = True) -> int:
    """The output gradient a zero-bubble chunk keeps from B to W: on the last model stage the logits' or (fused
    loss) the per-token loss's (plan/head.py)."""
    tokens = micro_batch * seq_len
    if last:
        return head_output_grad_bytes(cfg, at, tokens, fused_loss)
    return at.act_bytes * cfg.hidden_size * tokens // at.sp_div


def weight_grad_bytes(cfg: ModelConfig, at: RankLayout, training: TrainingSpec, layers=None) -> tuple:
    """(layer, head, embedding) bytes of the 16-bit weight gradient autograd holds on its way to the fp32 main grads:
    the largest one of `layers` (default: every layer), the head's, the embedding's dense one (never fused).
    Gradient-accumulation fusion (tpzoo.parallel.wgrad) spares the column/row-parallel weights' and the head's (the
    fused linear cross-entropy's too), but not at ZeRO >= 2 for a weight crossing a bucket boundary (counted: the
    largest) nor stacked or replicated weights (experts, routers, latent down projections). LoRA: none."""
    if training.lora_rank:
        return 0, 0, 0
    e, h = at.act_bytes, cfg.hidden_size
    vocab = local_vocab(cfg, at.tp, training.vocab_padding_multiple)
    unfused = not training.grad_accumulation_fusion or training.zero_level >= 2
    ids = range(cfg.num_layers) if layers is None else layers
    layer = max([layer_cost(cfg, i, at).largest_weight_grad(e, unfused) for i in ids] + [0])
    return layer, e * vocab * h if unfused else 0, e * vocab * h


@dataclass
class MemoryBreakdown:
    stage: int            # the pipeline stage this breakdown is for (the fullest one)
    params: int
    grads: int
    master: int
    optimizer: int
    activations: int
    transient: int        # backward working set (one layer's activations or the head's, and 16-bit weight
                          # gradients) + recv buffers (+ ZeRO-2's staging buffers, + ZeRO-3's gathered layers,
                          # + FP8's casts)
    reserve: int

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.master + self.optimizer + self.activations + self.transient
                + self.reserve)


def stage_memory(cfg: ModelConfig, layout: Layout, training: TrainingSpec, stage: int,
                 reserve_bytes: int = 0) -> MemoryBreakdown:
    """Peak memory of one GPU of pipeline stage `stage` (any tp/dp rank: they hold the same sizes)."""
    at = RankLayout.of(layout, training)  # compiled blocks: the fused kernels' saved tensors (spec.py)
    e, p, v, t = training.act_bytes, layout.pp, layout.virtual_stages, layout.tp
    fused = training.fused_linear_cross_entropy
    b, s, sp = layout.micro_batch_size, local_seq_len(layout, training), layout.sequence_parallel
    replicas = layout.grad_replicas  # the optimizer shards over dp x cp
    count = stage_params(cfg, layout, stage, training.vocab_padding_multiple)
    st = expert_state_bytes(count, training, replicas, layout.ep, late_params(count, t, sp),
                            resident_params(cfg, count, training, t, replicas, stage == 0, stage == p - 1))
    ids = stage_layer_ids(cfg, layout, stage)
    if training.lora_rank:  # the base frozen in the model dtype; the adapters trained as a small model
        r, ep, x = training.lora_rank, layout.ep, training.lora_experts
        experts = sum(lora_layer_expert_params(cfg, i, t, r, ep) for i in ids) if x else 0
        adapters = expert_state_bytes(ParamCount(sum(lora_layer_params(cfg, i, t, r, ep, x) for i in ids), 0, 0, 0, 0,
                                                 0, expert=experts),
                                      training, replicas, ep, sum(lora_layer_late(cfg, i, t, r, ep, x) for i in ids))
        base = base_bytes(cfg, count.numel, ids, t, layout.ep, e, training.base_dtype)  # (plan/quant.py)
        st = StateBytes(base + adapters.params, adapters.grads, adapters.master, adapters.optimizer)
    if training.optimizer == "muon":  # one moment for Muon's matrices (plan/muon.py, which reads this module)
        from .muon import muon_state

        st = muon_state(cfg, layout, training, stage, st)
    m = num_micro_batches(layout, training)
    acts, grads = [], []
    for c, (lo, hi) in enumerate(stage_chunks(cfg, layout, stage)):
        first, last = c * p + stage == 0, c * p + stage == p * v - 1
        parts = chunk_activation_bytes(cfg, at, range(lo, hi), b, s, first, last, training.lora_rank, fused,
                                       training.lora_experts)
        acts.append(sum(parts.values()))
        grads.append(output_grad_bytes(cfg, at, b, s, last, fused))
    held = peak_bytes(held_states(layout.schedule, stage, p, m, v), acts, grads)
    plain = at.replace(recompute="none")
    one_layer = max([layer_activation_bytes(cfg, i, plain, b, s) for i in ids] + [0])
    # 16-bit weight gradients on their way to the main grads; an unfused tied head's waits for the embedding's
    layer_w, head_w, embed_w = weight_grad_bytes(cfg, at, training, ids)
    tied_head = head_w if cfg.tie_embeddings and p == 1 else 0
    head = head_transient_bytes(cfg, at, b * s, fused, not training.lora_rank, head_w) if stage == p - 1 else 0
    backward = max(one_layer + layer_w + tied_head, head, embed_w + tied_head if stage == 0 else 0)
    # The engine posts the receive buffers of the current and the next action ahead of need.
    recv = 2 * output_grad_bytes(cfg, at, b, s, False) if p > 1 else 0
    # ZeRO-2: the fp32 staging buffers of the buckets being filled or reduce-scattered (about two at a time).
    staging = 2 * 4 * min(bucket_size(training, replicas), count.numel) if training.zero_level >= 2 else 0
    # ZeRO-3: the layers gathered for use (gathered_bytes)
    gathered = gathered_bytes(cfg, count, training, t, replicas, ids) if not training.lora_rank else 0
    # FP8: the fp8 copies of the largest projection's operands during its backward, and the weights' fp8 copies
    # kept for the step (cast per use under ZeRO-3) (plan/fp8.py, which reads this module: imported here)
    from .fp8 import fp8_transient_bytes, fp8_weight_bytes

    per_use = training.zero_level >= 3
    casts = fp8_transient_bytes(cfg, at, b * s, ids, per_use) if training.fp8 != "none" else 0
    fp8_weights = fp8_weight_bytes(cfg, t, ids) if training.fp8 != "none" and not per_use else 0
    from .post import frozen_stage_bytes  # DPO's reference copy, a distillation teacher (plan/post.py)

    frozen = frozen_stage_bytes(training, layout, stage)
    return MemoryBreakdown(stage, st.params + fp8_weights + frozen, st.grads, st.master, st.optimizer, held,
                           backward + recv + staging + gathered + casts, reserve_bytes)
