"""The plan advisor's memory model against tpzoo itself, on CPU.

Parameters: every rank's part, built for a virtual rank (ParallelDims.for_rank) on the meta device (or for real),
byte for byte.
Training state: DistributedAdamW's buffers (with and without ZeRO-1, emulated dp/tp ranks), byte for byte.
Activations: the storages a forward creates that are still alive when it returns (tpzoo.plan.measure), for
the torch reference kernels here and the Triton kernels in test_plan_parallel.py (interpreter processes).
"""
import pytest
import torch

from tpzoo.models import Inputs, LossOptions, ModelLayout, Stage, Transformer, apply_recompute, get_config
from tpzoo.models.config import ModelConfig
from tpzoo.parallel import ParallelDims
from tpzoo.plan import (Layout, RankLayout, TrainingSpec, chunk_activation_bytes, chunk_layer_ranges, stage_chunks,
                        stage_params, state_bytes)
from tpzoo.plan.measure import forward_activation_bytes
from tpzoo.train.optim import DistributedAdamW

# kv_heads (1) < tp: every tp rank keeps a replica of the one kv head; qkv bias and tied embeddings too.
GQA = ModelConfig.from_dict(dict(family="qwen2", vocab_size=101, hidden_size=64, num_layers=3, num_heads=8,
                                 num_kv_heads=1, ffn_hidden_size=96, max_position_embeddings=64, qkv_bias=True,
                                 tie_embeddings=True, name="gqa-kv1"))
SMALL = ["nano-gpt", "nano-llama", "tiny-llama", GQA]
# The 2024-25 switches: OLMo 2 (post-norms only, full-width q/k norms whose k part holds the replicated kv head) and
# Gemma 3 (pre+post norms, per-head q/k norms, GeGLU, head_dim independent of hidden / heads).
NEW_FAMILIES = [
    ModelConfig.from_dict(dict(
        family="olmo2", vocab_size=101, hidden_size=64, num_layers=3, num_heads=8, num_kv_heads=1,
        ffn_hidden_size=96, max_position_embeddings=64, qk_norm="full", pre_norm=False, post_norm=True,
        name="olmo2-kv1")),
    ModelConfig.from_dict(dict(
        family="gemma3", vocab_size=101, hidden_size=64, num_layers=3, num_heads=8, num_kv_heads=2,
        head_dim=16, ffn_hidden_size=96, max_position_embeddings=64, activation="geglu_tanh",
        qk_norm="head", post_norm=True, norm_offset=True, embed_scale=True, tie_embeddings=True,
        sliding_window=4, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_local_theta=10000.0, rope_theta=1e6, attn_scale=24, name="gemma3-tiny")),
]
TOL = 0.02  # activations: relative; the model is exact except CPU layer_norm's bf16 statistics (docs/plan.md)


def cfg_of(c):
    return get_config(c) if isinstance(c, str) else c


def build_stage(cfg, tp, rank, pp, stage, v=1, device="meta", dtype=torch.bfloat16, sp=False, pad=1, dp=1, ep=1):
    """The chunks tpzoo.pipeline.build_model_chunks gives pipeline rank `stage`, tp rank `rank` (the last dp
    rank of dp; expert parallelism ep)."""
    ranges = chunk_layer_ranges(cfg, Layout(pp=pp, virtual_stages=v))
    dims = ParallelDims.for_rank(tp=tp, pp=pp, dp=dp, tp_rank=rank, pp_rank=stage, dp_rank=dp - 1, device=device,
                                 ep=ep)
    layout = ModelLayout(dims, sequence_parallel=sp, vocab_padding_multiple=pad, dtype=dtype)
    chunks = [Transformer(cfg, layout, Stage(ranges[c * pp + stage], c * pp + stage == 0, c * pp + stage == pp * v - 1))
              for c in range(v)]
    if cfg.tie_embeddings and v > 1 and chunks[0].pre_process and chunks[-1].post_process:
        chunks[-1].lm_head.weight = chunks[0].embed.weight
    return chunks


def unique_params(chunks):
    seen = {}
    for ch in chunks:
        for p in ch.parameters():
            seen[id(p)] = p
    return list(seen.values())


LAYOUTS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 1), (4, 2, 1), (2, 2, 2), (1, 3, 1)]


PUBLISHED = ["llama-3-8b", "qwen2.5-0.5b", "gpt2", "qwen3-0.6b", "olmo-2-32b", "gemma-2-2b", "gemma-3-27b"]


# the published shapes (their kinds are the small configs' and the new families') in the slow tier
@pytest.mark.parametrize("name", SMALL + NEW_FAMILIES + [pytest.param(n, marks=pytest.mark.slow) for n in PUBLISHED],
                         ids=lambda c: c if isinstance(c, str) else c.name)
def test_parameter_bytes_exact(name):
    cfg = cfg_of(name)
    for tp, pp, v in LAYOUTS:
        if cfg.num_heads % tp or pp * v > cfg.num_layers:
            continue
        for pad in (1, 8):
            for stage in range(pp):
                count = stage_params(cfg, Layout(tp=tp, pp=pp, virtual_stages=v), stage, pad)
                for rank in {0, tp - 1}:
                    params = unique_params(build_stage(cfg, tp, rank, pp, stage, v, sp=True, pad=pad))
                    what = f"{cfg.name} tp={tp} rank {rank} pp={pp} stage {stage} v={v} pad={pad}"
                    assert count.numel * 2 == sum(p.numel() * p.element_size() for p in params), what
                    assert count.tensors == len(params), what
                    assert count.sequence_parallel == sum(p.numel() for p in params if p.sequence_parallel), what
                    replicated = sum(p.numel() for p in params if p.tp_spec.replicas and max(p.tp_spec.replicas) > 1)
                    assert count.replicated_kv == replicated, what


def test_tied_embedding_held_on_both_end_stages():
    cfg = get_config("nano-gpt")
    first, last = stage_params(cfg, Layout(tp=2, pp=2), 0), stage_params(cfg, Layout(tp=2, pp=2), 1)
    table = 49 * cfg.hidden_size  # 97 padded to 98, split over tp=2
    assert first.embedding == last.embedding == table
    assert stage_params(cfg, Layout(tp=2), 0).embedding == 0  # one stage: the head is the embedding itself


@pytest.mark.parametrize("zero1", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_optimizer_state_matches_distributed_adamw(dtype, zero1):
    """DistributedAdamW built for emulated ranks (no process group is needed to construct it)."""
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    training = TrainingSpec(seq_len=16, global_batch_size=8, dtype=dtype, zero1=zero1)
    for name in ("nano-gpt", "nano-llama", GQA):
        cfg = cfg_of(name)
        for tp, rank, pp, stage, dp in [(1, 0, 1, 0, 1), (2, 1, 1, 0, 3), (2, 0, 2, 1, 4), (1, 0, 2, 1, 2)]:
            chunks = build_stage(cfg, tp, rank, pp, stage, device="cpu", dtype=torch.float32, dp=dp)
            opt = DistributedAdamW(unique_params(chunks), chunks[0].dims, model_dtype=torch_dtype, zero1=zero1)
            count = stage_params(cfg, Layout(tp=tp, pp=pp), stage)
            est = state_bytes(count, training, dp)
            got = opt.buffer_bytes()
            what = f"{cfg.name} tp={tp}/{rank} pp={pp}/{stage} dp={dp}"
            assert (est.params, est.master, est.optimizer, est.grads) == (
                got["params"], got["master"], got["optimizer"], got["grads"]), what


def test_one_real_step_allocates_what_is_estimated():
    """World size 1: forward, backward, reduce_grads and step of DistributedAdamW in bf16; then every buffer
    the step created, the parameters' gradients included, is counted by the estimate."""
    cfg = get_config("nano-llama")
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = DistributedAdamW(list(model.parameters()), model.dims, model_dtype=torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    opt.zero_grad()
    model(Inputs(ids, labels=ids)).sum().backward()
    opt.reduce_grads()
    opt.step(lr=1e-3)
    est = state_bytes(stage_params(cfg, Layout(), 0), TrainingSpec(seq_len=16, global_batch_size=2))
    assert all(p.grad is None and p.main_grad.dtype == torch.float32 for p in model.parameters())
    got = opt.buffer_bytes()
    assert (est.params, est.master, est.optimizer, est.grads) == (
        got["params"], got["master"], got["optimizer"], got["grads"])
    # every gradient lives inside the counted buffers: nothing was allocated beside them
    grad_storages = {p.main_grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert grad_storages == {opt.grads.data.untyped_storage().data_ptr()}


def test_weight_gradients_autograd_holds_are_the_plans():
    """The 16-bit weight gradients the plan's backward working set counts (weight_grad_bytes): in a real bf16
    backward at tp = 1, the largest gradient tensor autograd hands a layer's matrix, the head and the embedding,
    with gradient-accumulation fusion on (none for the column/row-parallel matrices and the head) and off, with
    the fused linear cross-entropy (the default head) and the unfused one."""
    from tpzoo.plan.memory import weight_grad_bytes

    for name, fused_head in (("nano-gpt", True), ("nano-llama", True), ("nano-llama", False)):
        cfg = get_config(name)  # tied GeLU with biases; untied SwiGLU
        for fused in (True, False):
            model = Transformer(cfg)
            opt = DistributedAdamW(list(model.parameters()), model.dims, model_dtype=torch.bfloat16,
                                   grad_accumulation_fusion=fused)
            seen = {"layer": 0, "head": 0, "embedding": 0}
            for n, p in model.named_parameters():
                kind = ("layer" if n.startswith("layers.") and p.dim() == 2 else "head" if n == "lm_head.weight"
                        else "embedding" if n == "embed.weight" else None)
                if kind:
                    p.register_hook(lambda g, k=kind: seen.__setitem__(k, max(seen[k], 0 if g is None else
                                                                              g.numel() * g.element_size())))
            opt.zero_grad()
            ids = torch.randint(0, cfg.vocab_size, (2, 16))
            model(Inputs(ids, labels=ids), loss=LossOptions(fused=fused_head)).sum().backward()
            layer, head, embedding = weight_grad_bytes(cfg, RankLayout(), TrainingSpec(16, 2, grad_accumulation_fusion=fused))
            if cfg.tie_embeddings:  # the head's gradient joins the embedding's (one tensor, counted there)
                assert head == (0 if fused else embedding)
                head = 0
            assert (seen["layer"], seen["head"], seen["embedding"]) == (layer, head, embedding), \
                (name, fused_head, fused, seen)


def measure_chunk(cfg, mode, *, layers=None, pre=True, post=True, b=2, s=16, hooks=False, fused=True):
    torch.manual_seed(0)
    model = apply_recompute(Transformer(cfg, ModelLayout(dtype=torch.bfloat16), Stage(layers, pre, post)), mode)
    return forward_activation_bytes(model, b, s, hooks=hooks, loss=LossOptions(fused=fused))


# default tier: LayerNorm / GeLU / learned positions (nano-gpt) and RMSNorm / SwiGLU / RoPE with one kv head (GQA);
# the other Llama shapes in the slow tier
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("nano-llama", "tiny-llama") else n
                                  for n in SMALL], ids=lambda c: c if isinstance(c, str) else c.name)
def test_activation_bytes_tp1_reference_kernels(name):
    cfg = cfg_of(name)
    for mode in ("none", "selective", "full"):
        for fused in (True, False):  # the head and loss fused (the default) or not (plan/head.py)
            got = measure_chunk(cfg, mode, fused=fused)
            est = sum(chunk_activation_bytes(cfg, RankLayout(recompute=mode, kernels="reference"),
                                             range(cfg.num_layers), 2, 16, True, True, fused_loss=fused).values())
            assert abs(est / got - 1) <= TOL, (cfg.name, mode, fused, est, got)


def test_activation_bytes_pipeline_stages():
    """pp=2: the first stage (embedding, its output kept for the backward) and the last (input received; the
    head and loss fused or not)."""
    cfg = get_config("tiny-llama")
    (r0, r1) = chunk_layer_ranges(cfg, Layout(pp=2))
    for mode in ("none", "full"):
        for (lo, hi), pre, post in (((r0), True, False), ((r1), False, True)):
            for fused in (True, False) if post else (True,):
                got = measure_chunk(cfg, mode, layers=(lo, hi), pre=pre, post=post, fused=fused)
                est = sum(chunk_activation_bytes(cfg, RankLayout(recompute=mode, kernels="reference"), range(lo, hi),
                                                 2, 16, pre, post, fused_loss=fused).values())
                assert est == got, (mode, pre, post, fused, est, got)


def test_rotary_tables_one_per_distinct_spec():
    """A chunk computes each distinct rotary table once (cos and sin, s x rotary_dim / 2 fp32 each): Gemma 3's
    local and global thetas are two tables where a chunk holds both kinds of layer, one where it holds one;
    a partial rotary factor shrinks it (full recomputation: the layers keep their inputs, the tables stay)."""
    partial = get_config("tiny-llama").replace(partial_rotary_factor=0.5)
    gemma = NEW_FAMILIES[1]
    for cfg, layers, tables in ((gemma, (0, 2), 1), (gemma, (0, 3), 2), (gemma, (2, 3), 1), (partial, (0, 3), 1)):
        got = measure_chunk(cfg, "full", layers=layers, pre=False, post=False)
        parts = chunk_activation_bytes(cfg, RankLayout(recompute="full", kernels="reference"), range(*layers), 2, 16,
                                       False, False)
        assert sum(parts.values()) == got, (cfg.name, layers)
        assert parts["rope"] == tables * 4 * 16 * cfg.attention.rotary_dim, (cfg.name, layers)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_head_peak_is_modeled(dtype):
    """The fused head's peak (forward + backward, torch path): what it keeps (plan/head.py
    head_activation_bytes, less the input made outside) plus its working set (head_transient_bytes) plus the
    per-token loss the caller holds, within 1%; the same at 4x the tokens (the working set is the chunk's)."""
    from tpzoo import kernels as K
    from tpzoo.plan.head import head_activation_bytes, head_transient_bytes
    from tpzoo.plan.measure import peak_live_bytes

    e, vocab = torch.finfo(dtype).bits // 8, 1000
    for cap in (None, 5.0):
        cfg = get_config("nano-llama").replace(vocab_size=vocab, final_softcap=cap)
        h = cfg.hidden_size
        for tokens in (256, 1024):
            g = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, h, generator=g).to(dtype).requires_grad_()
            w = torch.randn(vocab, h, generator=g).to(dtype).requires_grad_()
            t = torch.randint(0, vocab, (tokens,), generator=g)
            with peak_live_bytes() as r:
                loss = K.linear_cross_entropy(x, w, t, softcap=cap, vocab_size=vocab)
                loss.sum().backward()
            at = RankLayout(act_bytes=e, kernels="reference")
            kept = head_activation_bytes(cfg, at, tokens, True, 0) - e * h * tokens - 4
            est = kept + head_transient_bytes(cfg, at, tokens, True) + 4 * tokens
            assert abs(r.peak / est - 1) <= 0.01, (dtype, cap, tokens, r.peak, est)


def test_saved_tensor_hooks_agree_with_live_storages():
    """Autograd's saved tensors (hooks) are all a forward keeps, the held fp32 loss scalar aside: the two
    instruments agree, with and without recomputation."""
    for name in ("nano-llama", "nano-gpt", GQA):
        cfg = cfg_of(name)
        for mode in ("none", "selective", "full"):
            live, saved = measure_chunk(cfg, mode), measure_chunk(cfg, mode, hooks=True)
            assert live - saved == 4, (cfg.name, mode, live, saved)


def test_layout_chunks_follow_tpzoo_partition():
    from tpzoo.pipeline import partition_layers

    cfg = get_config("llama-3.1-405b")
    assert list(chunk_layer_ranges(cfg, Layout(pp=16))) == partition_layers(cfg, 16)
    assert stage_chunks(cfg, Layout(pp=4, virtual_stages=2), 1) == tuple(partition_layers(cfg, 4, virtual_stages=2)[1::4])
    assert Layout(tp=8, pp=16, dp=128).gpus == 16384


def test_plan_reports_megatrons_18_bytes_per_parameter_in_bf16():
    from tpzoo.plan.memory import state_bytes_per_param

    spec = dict(seq_len=16, global_batch_size=8)
    assert state_bytes_per_param(TrainingSpec(**spec)) == "18 B/param"  # 2 weights + 4 main grads + 4 + 8
    assert state_bytes_per_param(TrainingSpec(**spec, dtype="fp32")) == "16 B/param"
    assert state_bytes_per_param(TrainingSpec(**spec, zero1=True)) == "6 + 16/dp B/param"
    assert state_bytes_per_param(TrainingSpec(**spec, zero=2)) == "2 + 16/dp B/param"  # the weights stay whole
    assert state_bytes_per_param(TrainingSpec(**spec, zero=3)) == "18/dp B/param"  # everything sharded
