"""The last model stage's head in the plan: final norm, LM head and loss, fused (the default) or not.

Per micro-batch of T tokens (e = activation bytes, V = padded vocab / tp, h = hidden, d = tp under SP else 1),
what the forward keeps for the backward, besides the final norm's own saved tensors:
  unfused (fused_linear_cross_entropy = false): the head's input (e h T / d: this rank's shard under SP), the
      logits (fused kernels: e V T; torch reference: the fp32 softmax, 4 V T) and per-token loss statistics
      (5 resp. 10 bytes); the backward's working set is the logits' gradient, e V T.
  fused (tpzoo.kernels.fused_linear_cross_entropy): the hidden states' gradient G computed in the forward
      (e h T / d); when the head weight trains, also the fp32 weight gradient G_W (4 V h, whatever T), the
      input (e h T / d) and an fp32 log-sum-exp per token (4 T), which only a per-token-weighted loss uses.
      The working set: one chunk of c = default_chunk_rows(T, h) tokens in the forward, its logits (e c V; a
      soft cap one more) and then either the torch reference's fp32 softmax work (8 c V in 16-bit: a copy and
      the exp; 4 c V in fp32) or the weight-gradient matmul's operands (the torch path's gradient, e c V, and in
      16-bit the chunk's product, e V h); in the backward the scaled weight gradient handed to autograd (e V h;
      none where gradient-accumulation fusion adds it into the fp32 main gradient, tpzoo.parallel.wgrad) and the
      input gradient (e h T / d).
Plus the per-token loss the caller sums: 4 bytes, the fp32 scalar it holds.
Zero-bubble keeps from B to W the gradient of the stage output: unfused the logits' (e V T), fused the per-token
loss's, which autograd hands over as one expanded fp32 scalar (4 bytes).
TP collectives of the head and loss per micro-batch (T tokens, the whole sequence): unfused, the column layer's
(forward all-gather and backward all-gather + reduce-scatter under SP, else a backward all-reduce) and the loss's
two all-reduces (T and 3T fp32); fused, under SP the input's all-gather and G's reduce-scatter, else G's
all-reduce, all in the forward, and one all-gather of 4 fp32 per token and rank for each chunk.
"""
from __future__ import annotations

from tpzoo.kernels.fused_linear_cross_entropy import default_chunk_rows
from tpzoo.models.config import ModelConfig


def local_vocab(cfg: ModelConfig, tp: int, pad: int = 1) -> int:
    """Rows of the embedding and the head on one tp rank: the vocab padded to a multiple of tp * pad, split."""
    step = tp * pad
    return -(-cfg.vocab_size // step) * step // tp


def head_activation_bytes(cfg: ModelConfig, at, tokens: int, fused: bool, norm_saved: int) -> int:
    """Bytes the final norm, head and loss keep for the backward of one micro-batch at `at` (spec.RankLayout;
    module docstring); `norm_saved`: bytes per token the final norm keeps (plan.layers.norm_saved)."""
    e, kernels = at.act_bytes, at.kernels
    h, v = cfg.hidden_size, local_vocab(cfg, at.tp, at.vocab_padding_multiple)
    sp_div = at.sp_div
    norm = norm_saved * tokens // sp_div
    if not fused:
        logits = (4 if kernels == "reference" else e) * v
        stats = 10 if kernels == "reference" else 5
        return norm + e * h * tokens // sp_div + (logits + stats) * tokens + 4
    return norm + 2 * e * h * tokens // sp_div + 4 * tokens + 4 * v * h + 4


def frozen_head_savings(cfg: ModelConfig, at, tokens: int, fused: bool) -> int:
    """What a frozen head (LoRA) keeps less than a trained one: unfused its input (without SP; with SP the column
    layer keeps the shard anyway); fused the input, the log-sum-exp and the weight gradient."""
    e, tp = at.act_bytes, at.tp
    if not fused:
        return 0 if at.sequence_parallel and tp > 1 else e * cfg.hidden_size * tokens
    v = local_vocab(cfg, tp, at.vocab_padding_multiple)
    return e * cfg.hidden_size * tokens // at.sp_div + 4 * tokens + 4 * v * cfg.hidden_size


def head_output_grad_bytes(cfg: ModelConfig, at, tokens: int, fused: bool) -> int:
    """The output gradient zero-bubble keeps from B to W on the last stage."""
    return 4 if fused else at.act_bytes * local_vocab(cfg, at.tp, at.vocab_padding_multiple) * tokens


def head_transient_bytes(cfg: ModelConfig, at, tokens: int, fused: bool, head_trains: bool = True,
                         weight_grad: int | None = None) -> int:
    """The head's working set on top of what is kept (module docstring); a frozen head (LoRA) has no weight
    gradient to compute. `weight_grad`: the bytes of the 16-bit head weight gradient autograd holds in the
    backward (plan.memory.weight_grad_bytes: 0 where it is fused into the main gradient). None: a bare head's
    (no GradBuffer), e V h for the fused head when it trains, left out for the unfused one (its estimate is the
    logits' gradient, which scripts/bench/loss_head.py compares with)."""
    e, kernels = at.act_bytes, at.kernels
    h, v = cfg.hidden_size, local_vocab(cfg, at.tp, at.vocab_padding_multiple)
    if not fused:
        return e * v * tokens + (weight_grad or 0)
    c = default_chunk_rows(tokens, h)
    torch_path = kernels == "reference"
    logits = c * v * (e + (e if cfg.final_softcap else 0))  # the chunk's logits (+ the capped ones)
    # statistics and gradient: the torch path's fp32 copy and exp (or its result; a view of fp32 logits)
    softmax = c * v * ((8 if e < 4 else 4) if torch_path else 0)
    # the weight-gradient matmul: the torch path's gradient is a new tensor; a 16-bit product is summed in fp32
    product = c * v * (e if torch_path else 0) + (e * v * h if e < 4 else 0)
    if weight_grad is None:
        weight_grad = e * v * h if head_trains else 0
    forward = logits + max(softmax, product if head_trains else 0)
    return max(forward, weight_grad + e * h * tokens // at.sp_div)


def head_collectives(cfg: ModelConfig, at, tokens: int, fused: bool) -> list:
    """The head's and the loss's TP collectives of one micro-batch of `tokens` tokens at `at` (module docstring),
    as plan/kinds Collective entries with their phase."""
    from .costs import Collective

    if at.tp == 1:
        return []
    full = tokens * cfg.hidden_size * at.act_bytes
    out = []
    if at.sequence_parallel:  # the input gathered; fused: G reduce-scattered in the forward, unfused in backward
        out += [Collective("all_gather", "tp", full),
                Collective("reduce_scatter", "tp", full, phase="forward" if fused else "backward")]
        if not fused:  # the column layer's input again, for the weight gradient
            out.append(Collective("all_gather", "tp", full, phase="regather"))
    else:
        out.append(Collective("all_reduce", "tp", full, phase="forward" if fused else "backward"))
    if not fused:
        return out + [Collective("all_reduce", "tp", tokens * 4),       # max of the logits, fp32 per token
                      Collective("all_reduce", "tp", tokens * 4 * 3)]   # target logit, sum exp, sum logits
    rows = default_chunk_rows(tokens, cfg.hidden_size)
    whole, rest = divmod(tokens, rows)
    out.append(Collective("all_gather", "tp", at.tp * 4 * rows * 4, whole))  # payload: the gathered statistics
    if rest:
        out.append(Collective("all_gather", "tp", at.tp * 4 * rest * 4))
    return out
