"""Per-GPU memory of a tpzoo training layout: parameters, gradients, optimizer states, activations.

Parameters are counted exactly as tpzoo.models.Transformer builds a rank's part (tested against the real
model): vocab padded to tp * multiple, kv heads replicated when kv_heads < tp, norms and row-parallel biases
replicated, a tied embedding held twice (first and last stage) when pp > 1.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
re-derived for what tpzoo's code saves for the backward (tested against live storages on CPU). Per layer and
token, with e = activation bytes, local sizes q = heads*hd/tp, kv = local kv heads*hd, f = ffn/tp, a = heads/tp,
d = tp under sequence parallelism else 1:
    norms      2 * norm_saved / d        fused: e*h + 4 (rms) / + 8 (layer norm); torch rms: 4h + e*h + 4
    linear in  2 * e*h / d               qkv and fc_in inputs: under SP only this rank's sequence shard is
                                         kept, the backward gathers it again (tpzoo.parallel.column_linear)
    attention  e*(q + 2kv) + e*(q + kv) + e*q + 4a
               qkv buffer (whole: v is a view of it) + rotated q, k (RoPE only) + output + log-sum-exp;
               flash attention (SDPA) never materializes the s^2 scores: the paper's 5as/h term is absent
    mlp        SwiGLU fused 3e*f, torch 4e*f (silu output too); GeLU 2e*f
Selective recompute (tpzoo checkpoints only the attention core) drops just the 4a log-sum-exp: q, k, v are
kept alive as the checkpoint's inputs and the output feeds the projection. Full recompute keeps each layer's
input, e*h/d per token (the paper's 2sbh). How many micro-batches a stage holds comes from replaying tpzoo's
schedule (plan/schedule.py).

Training state, as tpzoo.train.optim.DistributedAdamW allocates it (tested against it): one flat parameter
buffer in the model dtype padded to a multiple of dp (P elements); the fp32 main-gradient buffer (P) that every
micro-batch's gradients are added into as autograd produces them (Megatron's main_grad: no 16-bit .grad is kept);
fp32 master (16-bit models), exp_avg and exp_avg_sq over the owned range (P, or P/dp under ZeRO-1); under ZeRO-1
with dp > 1 the reduce-scattered fp32 gradient shard (P/dp). So 18 bytes per element in bf16 without ZeRO-1
(Megatron's figure), 16 in fp32. Under context parallelism "dp" here is dp x cp (the ranks that hold the same
parameters), and every activation term counts the seq_len / cp tokens of a cp rank (ring attention keeps what
SDPA keeps: q, k, v, its output and the log-sum-exp).
Mixtures of experts (docs/plan.md): an MoE layer holds a replicated router and E/ep experts split over tp (etp =
tp); at ep > 1 the expert weights have their own optimizer over edp = dp x cp / ep (expert_state_bytes); the MoE
MLP keeps k dispatched rows per token and their experts' intermediates (moe_mlp_bytes).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tpzoo.models.config import ModelConfig

from .experts import moe_mlp_bytes
from .head import head_activation_bytes, head_output_grad_bytes, head_transient_bytes
from .lora import lora_chunk_activation_delta, lora_layer_late, lora_layer_params
from .schedule import held_states, peak_bytes
from .spec import DTYPE_BYTES, Layout, TrainingSpec, local_seq_len, num_micro_batches, stage_chunks


@dataclass(frozen=True)
class LocalDims:
    """One tensor-parallel rank's share of a layer (tpzoo.models.kinds (attention.py, mlp.py))."""
    q: int          # query features (heads/tp * head_dim)
    kv: int         # key (= value) features, replicated heads included
    heads: int
    ffn: int
    vocab: int      # padded vocab / tp


def local_dims(cfg: ModelConfig, tp: int, vocab_padding_multiple: int = 1) -> LocalDims:
    hd = cfg.head_dim
    kv_heads = max(1, cfg.num_kv_heads // tp)  # each rank keeps one replicated kv head when kv_heads < tp
    step = tp * vocab_padding_multiple
    vocab_padded = math.ceil(cfg.vocab_size / step) * step
    return LocalDims(q=cfg.num_heads // tp * hd, kv=kv_heads * hd, heads=cfg.num_heads // tp,
                     ffn=cfg.ffn_hidden_size // tp, vocab=vocab_padded // tp)


# -- parameters ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamCount:
    numel: int              # elements of this rank's parameters (a shared tied weight once)
    tensors: int            # parameter tensors
    matmul: int             # elements of the layers' matmul weights (FLOPs per token = 2 * this, forward)
    sequence_parallel: int  # replicated elements whose gradient is partial under SP (summed over tp)
    replicated_kv: int      # elements of qkv tensors holding replicated kv heads (gradients summed over tp)
    embedding: int          # elements of a tied embedding/head copy kept in sync over the embedding group
    expert: int = 0         # elements of expert weights (MoE): at ep > 1 in their own optimizer, over edp


def layer_params(cfg: ModelConfig, tp: int, moe: bool = False, ep: int = 1) -> ParamCount:
    """One layer on one tp rank; `moe`: its MLP is models/kinds/moe.py's MoE at expert parallelism `ep` (a
    replicated router E x h, partial under SP like a norm; E/ep local experts, each split over tp like the dense
    MLP: etp = tp). `matmul` counts the weights one token goes through: the router and k experts."""
    d = local_dims(cfg, tp)
    h = cfg.hidden_size
    norm = h * (2 if cfg.norm == "layernorm" else 1)
    norms = 2 * (int(cfg.pre_norm) + int(cfg.post_norm))  # hidden-size norms per layer
    n_in = d.ffn * (2 if cfg.gated else 1)
    qkv = d.q + 2 * d.kv
    matmul = h * qkv + d.q * h + h * n_in + d.ffn * h
    biases = (qkv if cfg.qkv_bias else 0) + (h if cfg.out_bias else 0) + ((n_in + h) if cfg.mlp_bias else 0)
    stored = matmul  # elements held (the matmul weights a token uses, for a dense layer)
    expert = router = 0
    if moe:  # the MoE MLP replaces the dense one (no biases)
        one = 3 * h * (cfg.expert_ffn // tp)  # one expert's gate|up and down, this rank's tp slice
        router, expert = cfg.num_experts * h, cfg.num_experts // ep * one
        matmul += router + cfg.num_experts_per_tok * one - (h * n_in + d.ffn * h)
        stored = matmul - cfg.num_experts_per_tok * one + expert
        biases -= (n_in + h) if cfg.mlp_bias else 0
    # q/k norms: per head (replicated, partial gradient summed over tp), or full width (split like q and k)
    qk = {"none": 0, "head": 2 * cfg.head_dim, "full": d.q + d.kv}[cfg.qk_norm]
    tensors = (norms * (2 if cfg.norm == "layernorm" else 1) + 4 + cfg.qkv_bias + cfg.out_bias
               + (1 if moe else 2 * cfg.mlp_bias) + (2 if cfg.qk_norm != "none" else 0))  # MoE: router, gate_up, down
    sp = (norms * norm + (h if cfg.out_bias else 0) + (h if cfg.mlp_bias and not moe else 0)
          + (qk if cfg.qk_norm == "head" else 0) + router)
    replicated = (h * qkv + (qkv if cfg.qkv_bias else 0)) if cfg.num_kv_heads < tp else 0
    if cfg.qk_norm == "full" and cfg.num_kv_heads < tp:
        replicated += d.kv  # k_norm's weight holds the replicated kv heads' part too
    return ParamCount(stored + biases + norms * norm + qk, tensors, matmul, sp, replicated, 0, expert)


def stage_params(cfg: ModelConfig, tp: int, pp: int, stage: int, virtual_stages: int = 1,
                 vocab_padding_multiple: int = 1, ep: int = 1) -> ParamCount:
    """Exactly the parameters of pipeline stage `stage` on one tp rank (all its model chunks) at expert
    parallelism `ep`."""
    h = cfg.hidden_size
    layer_ids = [i for s, e in stage_chunks(cfg, pp, stage, virtual_stages) for i in range(s, e)]
    n_layers = len(layer_ids)
    counts = [layer_params(cfg, tp, cfg.is_moe_layer(i), ep) for i in layer_ids]
    numel, tensors = sum(c.numel for c in counts), sum(c.tensors for c in counts)
    sp, matmul, expert = (sum(c.sequence_parallel for c in counts), sum(c.matmul for c in counts),
                          sum(c.expert for c in counts))
    lp = layer_params(cfg, tp)
    table = local_dims(cfg, tp, vocab_padding_multiple).vocab * h
    first, last = stage == 0, stage == pp - 1
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
    if cfg.tie_embeddings and pp > 1 and (first or last):
        embedding = table
    return ParamCount(numel, tensors, matmul, sp, n_layers * lp.replicated_kv, embedding, expert)


@dataclass(frozen=True)
class StateBytes:
    params: int       # the flat parameter buffer (model dtype, padded)
    grads: int        # fp32 main gradients (+ the reduce-scattered shard under ZeRO-1; ZeRO-2: shard + late buckets)
    master: int       # fp32 master weights of the owned range (16-bit models)
    optimizer: int    # exp_avg + exp_avg_sq of the owned range


def late_params(count: ParamCount, tp: int, sequence_parallel: bool) -> int:
    """Elements DistributedAdamW lays out last, reduced after finalize_grads (tpzoo.parallel.data_parallel):
    SP-replicated parameters (tp > 1), replicated kv heads, a tied embedding copy (pp > 1)."""
    return (count.sequence_parallel if sequence_parallel and tp > 1 else 0) + count.replicated_kv + count.embedding


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
    table = local_dims(cfg, tp, training.vocab_padding_multiple).vocab * cfg.hidden_size
    return min(padded, -(-table // bucket_size(training, dp)) * bucket_size(training, dp))


def gathered_bytes(cfg: ModelConfig, count: ParamCount, training: TrainingSpec, tp: int, dp: int) -> int:
    """ZeRO-3's gathered working set: at most three layers' buffers at once (the one in use, the next one
    prefetched, one whose backward just ended), each the whole buckets its weights touch; the largest layer is a
    transformer block or the (untied) embedding table or head."""
    if training.zero_level < 3:
        return 0
    padded = -(-max(count.numel, 1) // dp) * dp
    table = local_dims(cfg, tp, training.vocab_padding_multiple).vocab * cfg.hidden_size
    largest = max(layer_params(cfg, tp, cfg.num_experts > 0).numel, table)  # ZeRO-3: ep = 1
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
def _norm_saved(cfg: ModelConfig, e: int, kernels: str) -> int:
    """Bytes per token a norm saves: its input and fp32 row statistics (the torch RMSNorm saves an fp32 copy
    of its input instead, and the normalized tensor before the weight)."""
    h = cfg.hidden_size
    if cfg.norm == "layernorm":
        return e * h + 8  # input, mean, rstd (torch and Triton alike)
    return (4 * h + e * h + 4) if kernels == "reference" else (e * h + 4)


def layer_activation_bytes(cfg: ModelConfig, tp: int, sequence_parallel: bool, recompute: str, tokens: int,
                           e: int, kernels: str = "fused", moe: bool = False, ep: int = 1) -> int:
    """Bytes one layer keeps for the backward of one micro-batch of `tokens` tokens (b * s); `moe`: its MLP
    is a mixture of experts (moe_mlp_bytes: the router input takes the place of fc_in's)."""
    h = cfg.hidden_size
    sp_div = tp if sequence_parallel else 1
    if recompute == "full":  # the checkpoint's input (+ an MoE router's last_stats: logits and sums)
        stats = (e * cfg.num_experts * tokens // sp_div + 8 * cfg.num_experts + 8) if moe else 0
        return e * h * tokens // sp_div + stats
    d = local_dims(cfg, tp)
    attn = e * (d.q + 2 * d.kv) + e * d.q + (e * (d.q + d.kv) if cfg.position == "rope" else 0)
    if recompute != "selective":
        attn += 4 * d.heads
    shard = const = 0
    if moe:
        mlp, shard, const = moe_mlp_bytes(cfg, tp, sequence_parallel, e, kernels, ep)
    elif cfg.gated:  # SwiGLU and GeGLU: the same kernel pair (the torch references keep the same tensors too)
        mlp = e * d.ffn * (4 if kernels == "reference" else 3)
    else:
        mlp = 2 * e * d.ffn
    # The norms and the two column-parallel inputs (qkv, fc_in) are kept as this rank's sequence shard (the
    # column layers gather them again in backward); the rest is split by heads or ffn columns.
    norms = 2 * (int(cfg.pre_norm) + int(cfg.post_norm))
    return ((norms * _norm_saved(cfg, e, kernels) + 2 * e * h + shard) * tokens // sp_div + (attn + mlp) * tokens
            + const)


def chunk_activation_bytes(cfg: ModelConfig, tp: int, sequence_parallel: bool, recompute: str,
                           layers: int, micro_batch: int, seq_len: int, e: int, first: bool, last: bool,
                           kernels: str = "fused", vocab_padding_multiple: int = 1, lora_rank: int = 0,
                           moe_layers: int = 0, ep: int = 1, fused_loss: bool = True) -> dict:
    """Bytes a model chunk (one tpzoo Transformer) with `layers` layers keeps for one micro-batch, by part:
    layers, rope (cos/sin its layers share), embedding (lookup indices), head (final norm, head and loss on the
    last model stage, fused_loss or not: plan/head.py; elsewhere the output the pipeline engine keeps for the
    backward). `moe_layers` of the layers have a mixture-of-experts MLP (at expert parallelism `ep`)."""
    h, tokens = cfg.hidden_size, micro_batch * seq_len
    sp_div = tp if sequence_parallel else 1
    parts = {"layers": (layers - moe_layers) * layer_activation_bytes(cfg, tp, sequence_parallel, recompute, tokens,
                                                                      e, kernels)}
    if moe_layers:
        parts["layers"] += moe_layers * layer_activation_bytes(cfg, tp, sequence_parallel, recompute, tokens, e,
                                                               kernels, True, ep)
    parts["rope"] = 4 * seq_len * cfg.head_dim if (cfg.position == "rope" and layers) else 0
    embed = 9 * tokens if (first and tp > 1) else 0  # local ids (int64) + out-of-shard mask of the vocab split
    if first and cfg.position == "learned":
        embed += 8 * seq_len  # the position ids the position embedding saves
    parts["embedding"] = embed
    if last:  # final norm, head and loss (plan/head.py)
        parts["head"] = head_activation_bytes(cfg, tp, sequence_parallel, tokens, e, kernels, vocab_padding_multiple,
                                              fused_loss, _norm_saved(cfg, e, kernels))
    else:
        parts["head"] = e * h * tokens // sp_div  # the stage output, kept for its backward
    # The engine keeps a received input for its gradient; only the torch RMSNorm does not save it anyway (it
    # saves an fp32 copy), and under full recompute it is already counted as the checkpoint's input.
    keeps_input = cfg.norm == "rmsnorm" and kernels == "reference" and recompute != "full"
    parts["input"] = e * h * tokens // sp_div if (not first and layers and keeps_input) else 0
    if lora_rank:  # a frozen base with adapters (tpzoo.plan.lora)
        parts["lora"] = lora_chunk_activation_delta(cfg, tp, sequence_parallel, recompute, lora_rank, layers,
                                                    micro_batch, seq_len, e, first, last, kernels,
                                                    _norm_saved(cfg, e, kernels), vocab_padding_multiple,
                                                    fused_loss)
    return parts


def output_grad_bytes(cfg: ModelConfig, tp: int, sequence_parallel: bool, micro_batch: int, seq_len: int,
                      e: int, last: bool, vocab_padding_multiple: int = 1, fused_loss: bool = True) -> int:
    """The output gradient a zero-bubble chunk keeps from B to W: on the last model stage the logits' or (fused
    loss) the per-token loss's (plan/head.py)."""
    tokens = micro_batch * seq_len
    if last:
        return head_output_grad_bytes(cfg, tp, tokens, e, vocab_padding_multiple, fused_loss)
    return e * cfg.hidden_size * tokens // (tp if sequence_parallel else 1)


def weight_grad_bytes(cfg: ModelConfig, tp: int, e: int, training: TrainingSpec, ep: int = 1) -> tuple:
    """(layer, head, embedding) bytes of the 16-bit weight gradient autograd holds on its way to the fp32 main grads:
    a layer's largest weight's, the head's, the embedding's dense one (never fused). Gradient-accumulation fusion
    (tpzoo.parallel.wgrad) spares the column/row-parallel weights' and the head's (the fused linear cross-entropy's
    too), but not at ZeRO >= 2 for a weight crossing a bucket boundary (counted: the largest) nor the MoE experts'.
    LoRA: none."""
    if training.lora_rank:
        return 0, 0, 0
    d, h = local_dims(cfg, tp, training.vocab_padding_multiple), cfg.hidden_size
    unfused = not training.grad_accumulation_fusion or training.zero_level >= 2
    dense = e * h * max(d.q + 2 * d.kv, d.q, (2 if cfg.gated else 1) * d.ffn) if unfused else 0
    experts = e * (cfg.num_experts // ep) * 2 * (cfg.expert_ffn // tp) * h if cfg.num_experts else 0
    return max(dense, experts), e * d.vocab * h if unfused else 0, e * d.vocab * h


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
    e, k, p, v, t = training.act_bytes, training.kernels, layout.pp, layout.virtual_stages, layout.tp
    if training.compile:  # inductor's kernels for the compiled blocks save what the fused kernels do
        k = "fused"
    fused = training.fused_linear_cross_entropy
    b, s, sp, pad = layout.micro_batch_size, local_seq_len(layout, training), layout.sequence_parallel, \
        training.vocab_padding_multiple
    replicas = layout.grad_replicas  # the optimizer shards over dp x cp
    ep = layout.ep
    count = stage_params(cfg, t, p, stage, v, pad, ep)
    st = expert_state_bytes(count, training, replicas, ep, late_params(count, t, sp),
                            resident_params(cfg, count, training, t, replicas, stage == 0, stage == p - 1))
    if training.lora_rank:  # the base frozen in the model dtype; the adapters trained as a small model
        n_layers, r = sum(hi - lo for lo, hi in stage_chunks(cfg, p, stage, v)), training.lora_rank
        adapters = state_bytes(ParamCount(n_layers * lora_layer_params(cfg, t, r), 0, 0, 0, 0, 0), training,
                               replicas, n_layers * lora_layer_late(cfg, t, r))
        st = StateBytes(e * count.numel + adapters.params, adapters.grads, adapters.master, adapters.optimizer)
    m = num_micro_batches(layout, training)
    acts, grads = [], []
    for c, (lo, hi) in enumerate(stage_chunks(cfg, p, stage, v)):
        first, last = c * p + stage == 0, c * p + stage == p * v - 1
        parts = chunk_activation_bytes(cfg, t, sp, layout.recompute, hi - lo, b, s, e, first, last, k, pad,
                                       training.lora_rank, sum(map(cfg.is_moe_layer, range(lo, hi))), ep, fused)
        acts.append(sum(parts.values()))
        grads.append(output_grad_bytes(cfg, t, sp, b, s, e, last, pad, fused))
    held = peak_bytes(held_states(layout.schedule, stage, p, m, v), acts, grads)
    one_layer = layer_activation_bytes(cfg, t, sp, "none", b * s, e, k, cfg.num_experts > 0, ep)
    # 16-bit weight gradients on their way to the main grads; an unfused tied head's waits for the embedding's
    layer_w, head_w, embed_w = weight_grad_bytes(cfg, t, e, training, ep)
    tied_head = head_w if cfg.tie_embeddings and p == 1 else 0
    head = (head_transient_bytes(cfg, t, sp, b * s, e, k, pad, fused, not training.lora_rank, head_w)
            if stage == p - 1 else 0)
    backward = max(one_layer + layer_w + tied_head, head, embed_w + tied_head if stage == 0 else 0)
    # The engine posts the receive buffers of the current and the next action ahead of need.
    recv = 2 * output_grad_bytes(cfg, t, sp, b, s, e, False) if p > 1 else 0
    # ZeRO-2: the fp32 staging buffers of the buckets being filled or reduce-scattered (about two at a time).
    staging = 2 * 4 * min(bucket_size(training, replicas), count.numel) if training.zero_level >= 2 else 0
    # ZeRO-3: the layers gathered for use (gathered_bytes)
    gathered = gathered_bytes(cfg, count, training, t, replicas) if not training.lora_rank else 0
    # FP8: the fp8 copies of the largest projection's operands during its backward, and the weights' fp8 copies
    # kept for the step (cast per use under ZeRO-3) (plan/fp8.py, which reads this module's local_dims: imported
    # here)
    from .fp8 import fp8_transient_bytes, fp8_weight_bytes

    ids = [i for lo, hi in stage_chunks(cfg, p, stage, v) for i in range(lo, hi)]
    per_use = training.zero_level >= 3
    casts = fp8_transient_bytes(cfg, t, b * s, ids, per_use) if training.fp8 != "none" else 0
    fp8_weights = fp8_weight_bytes(cfg, t, ids) if training.fp8 != "none" and not per_use else 0
    return MemoryBreakdown(stage, st.params + fp8_weights, st.grads, st.master, st.optimizer, held,
                           backward + recv + staging + gathered + casts, reserve_bytes)
