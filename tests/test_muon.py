"""Muon (tpzoo.train.muon) against torch.optim.Muon, and at every layout against one process.

tp 1: DistributedMuon's update equals torch.optim.Muon's (adjust_lr_fn="match_rms_adamw", Nesterov, bfloat16
Newton-Schulz) on the same gradients, given to torch per Hugging Face projection by this file's own split (q_proj,
k_proj, v_proj, gate_proj, up_proj, each expert, MLA's five projections, Gated DeltaNet's q, k, v, z, b, a, a LoRA
adapter's A and B), and AdamW's for the rest; orthogonalizing q|k|v or gate|up fused would give another update
(checked to be far off).

Layouts: 3 steps at tp 2 + SP (kv heads replicated), pp 2, dp 2 at ZeRO 1 and 3, cp 2, ep 2 (a mixture of
experts), MLA + experts at tp 2 and LoRA at tp 2 equal one process (1e-5 of each tensor's largest entry); the slow
tier adds tp x dp at every ZeRO level, tp x pp, pp x dp, tp x cp, experts at tp 2 and at ZeRO-2, Gated DeltaNet at
tp 2 x dp 2, and a rank that owns no Muon element.
These run the Newton-Schulz iteration in float32: in bfloat16 the summation-order noise of two layouts' gradients
(1e-7) flips whole bfloat16 ulps of the update (1e-3 relative), so layouts could only be compared loosely; the
routing, the pieces and the arithmetic around the iteration are the same in both dtypes.

The multi-rank cases of one world size share one run_on_ranks call; strict collective mode is on (conftest).
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import tpzoo
from tpzoo.models import AttentionConfig, MLPConfig, MoEConfig, ModelConfig, Transformer, get_config
from tpzoo.models.config import SparseMLAConfig
from tpzoo.parallel import comm, gather_tp_tensor, param_spec
from tpzoo.parallel.context_parallel import shard_batch
from tpzoo.parallel.dims import local_dims
from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward
from tpzoo.testing import run_on_ranks
from tpzoo.train.expert_optim import ExpertParallelAdamW
from tpzoo.train.muon import DistributedMuon
from tpzoo.train.muon_matrices import place
from tpzoo.train.qk_clip import MaxLogits

from test_3d_parity import _full as unpadded
from test_3d_parity import assert_close

SEED, STEPS, LR, BUCKET, WAVE = 7, 3, 2e-2, 1000, 1 << 20  # one wave unless a layout asks for more
GLOBAL_BATCH, SEQ, MICRO = 4, 8, 1
# eps well above the rounding noise of the smallest gradients (test_zero.py says why): the embedding rows of rare
# tokens get gradients of ~1e-4, whose layout noise AdamW would otherwise divide by their own size
ADAM = dict(betas=(0.9, 0.95), eps=1e-3, weight_decay=0.1)
# relative to each tensor's largest entry. gdn: its b and a projections ([4, 32] here) are matrices with small
# gradients, and Muon normalizes each matrix's update whatever the gradient's size, so the relative rounding noise of
# two layouts' gradients shows in full (8.6e-7 where 1e-5 allows 7.7e-7 in the 'a' rows at tp 2)
# kimi: one embedding row of a rare token (AdamW's) 2.4e-5 of the table's largest entry from one process at tp 2 after
# three steps, the same rounding noise through the layers' tp-ordered sums
RTOL = {"gdn": 3e-5, "kimi": 3e-5}
_DEEPSEEK = get_config("tiny-deepseek-v3")
MODELS = {
    # one kv head: replicated over tp 2
    "llama": get_config("nano-llama").replace(num_layers=2, attention=AttentionConfig(4, num_kv_heads=1)),
    "moe": ModelConfig(family="mixtral", vocab_size=64, hidden_size=32, num_layers=2,
                       attention=AttentionConfig(num_heads=4, num_kv_heads=2), mlp=MLPConfig(32),
                       moe=MoEConfig(num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01)),
    "mla": _DEEPSEEK.replace(num_layers=2, token_mixers=["mla"] * 2, channel_mixers=["mlp", "moe"], vocab_size=64,
                             hidden_size=32, mlp=MLPConfig(48),
                             mla=dataclasses.replace(_DEEPSEEK.mla, q_lora_rank=24, kv_lora_rank=16,
                                                     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
                             moe=dataclasses.replace(_DEEPSEEK.moe, num_experts=4, ffn_hidden_size=16,
                                                     shared_expert_ffn=16, n_group=2, topk_group=1)),
    "gdn": get_config("nano-qwen3.5").replace(vocab_size=64),
    # Kimi Delta Attention layers around a NoPE latent attention layer (MuonClip clips the latter only)
    "kimi": get_config("nano-kimi-linear").replace(vocab_size=64),
    "gqa": get_config("nano-llama").replace(num_layers=2),  # 4 heads, 2 kv heads (MuonClip's groups)
    # a tied head far larger than a layer: at pp 2, ZeRO-1, one bucket, the last stage's second dp rank owns head
    # elements only, and still gathers and orthogonalizes its share of the matrices
    "tied": get_config("nano-llama").replace(num_layers=2, vocab_size=2048, tie_embeddings=True),
}
# DeepSeek Sparse Attention on mla's shapes: the indexer (frozen, the default) keeps 3 of the 8 keys
MODELS["dsa"] = MODELS["mla"].replace(token_mixers=["sparse_mla"] * 2, sparse_mla=SparseMLAConfig(
    index_topk=3, index_n_heads=4, index_head_dim=8))


# -- the Hugging Face projections, spelled out here (independent of tpzoo.train.muon_matrices) ------------------

def hf_projections(cfg, name: str, t: torch.Tensor) -> list | None:
    """The matrices torch.optim.Muon takes from full tensor `t` named `name` in a Hugging Face model of `cfg`
    (views of t), or None for AdamW's."""
    if ".lora." in name:
        return [t]
    if not name.startswith("layers.") or t.dim() < 2 or name.endswith(("router.weight", "conv.weight", "_gate.weight")):
        return None
    a, leaf = cfg.attention, name.split(".", 2)[2]
    if leaf.endswith("attn.qkv.weight"):  # q_proj | k_proj | v_proj
        q, kv = a.num_heads * a.head_dim * (2 if a.output_gate else 1), a.num_kv_heads * a.head_dim
        return list(t.split([q, kv, kv]))
    if leaf.endswith("fc_in.weight") and cfg.mlp.gated:  # gate_proj | up_proj
        return list(t.chunk(2))
    if leaf.endswith("attn.in_proj.weight"):  # GDN: q|k|v|z|b|a; KDA: q|k|v|b
        g = cfg.kimi_delta if cfg.token_mixer(int(name.split(".")[1])) == "kimi_delta" else cfg.gated_deltanet
        return list(t.split(list(g.in_proj_parts)))
    if leaf.endswith("mlp.gate_up"):  # every expert's gate_proj and up_proj
        return [m for e in t.unbind(0) for m in e.chunk(2)]
    if leaf.endswith("mlp.down"):
        return list(t.unbind(0))
    if t.dim() == 2 and leaf.endswith("weight"):
        return [t]
    raise AssertionError(f"unexpected matrix {name}")


def torch_optimizers(model, cfg, muon_lr: float = LR):
    """torch.optim.Muon over proxies of every HF projection, torch.optim.AdamW over the rest: (muon, adamw,
    copy_grads(), copy_back())."""
    proxies, others = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:  # a LoRA run's frozen base
            continue
        views = hf_projections(cfg, name, p.detach())
        if views is None:
            others.append(p)
        else:
            proxies.append((name, p, [torch.nn.Parameter(v.clone()) for v in views]))
    muon = torch.optim.Muon([x for *_, xs in proxies for x in xs], lr=muon_lr, weight_decay=ADAM["weight_decay"],
                            momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [p for p in others if p.dim() >= 2]},
                               {"params": [p for p in others if p.dim() < 2], "weight_decay": 0.0}], lr=LR,
                              **ADAM) if others else None

    def copy_grads(grads: dict) -> None:
        for name, p, xs in proxies:
            for x, g in zip(xs, hf_projections(cfg, name, grads[name])):
                x.grad = g.clone()
        for name, p in model.named_parameters():
            p.grad = grads[name].clone() if p in set(others) else None


    @torch.no_grad()
    def copy_back() -> None:
        for name, p, xs in proxies:
            for view, x in zip(hf_projections(cfg, name, p.data), xs):
                view.copy_(x)

    return muon, adamw, copy_grads, copy_back


# -- data ---------------------------------------------------------------------------------------------------------

def global_batch(cfg, step: int):
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((GLOBAL_BATCH, 1), -100)], dim=1)
    labels[torch.rand(labels.shape, generator=g) < 0.15] = -100
    return ids, labels


def local_batches(cfg, step: int, dims, sp: bool = False):
    ids, labels = global_batch(cfg, step)
    per = GLOBAL_BATCH // dims.dp
    rows = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
    mbs = [shard_batch({"input_ids": ids[rows][i:i + MICRO], "labels": labels[rows][i:i + MICRO]}, dims, sp)
           for i in range(0, per, MICRO)]
    return mbs, int((labels != -100).sum())


# -- one layout --------------------------------------------------------------------------------------------------

def _full(p, t, dims):
    t = gather_tp_tensor(t, param_spec(p), reduce="first", dims=dims)
    return comm.all_gather(t, dims.group("ep"), dim=0) if getattr(p, "expert_parallel", False) and dims.ep > 1 else t


def make_muon(chunks, dims, layout: dict, ns_dtype=torch.float32):
    params = list({id(p): p for c in chunks for p in c.parameters() if p.requires_grad}.values())
    inner = functools.partial(DistributedMuon, matrices=place(chunks), ns_dtype=ns_dtype,
                              wave_elems=layout.get("wave", WAVE))
    kw = dict(zero=layout.get("zero", 0), bucket_elems=layout.get("bucket", BUCKET), modules=chunks, **ADAM)
    if dims.ep > 1:
        return ExpertParallelAdamW(params, dims, inner=inner, **kw)
    return inner(params, dims, **kw)


def train_layout(layout: dict, steps: int = STEPS, local: bool = False) -> dict:
    """`steps` Muon steps of MODELS[layout["model"]] at `layout` on this rank (in this process with `local`):
    losses, the full parameters at the end, the counted exchange (calls and elements of all_to_all_v)."""
    cfg = MODELS[layout["model"]]
    dims = local_dims() if local else tpzoo.init_parallel(
        tp=layout.get("tp", 1), pp=layout.get("pp", 1), dp=layout.get("dp", 1), cp=layout.get("cp", 1),
        ep=layout.get("ep", 1))
    try:
        sp = layout.get("sp", False)
        chunks = build_model_chunks(cfg, dims, sequence_parallel=sp, seed=SEED)
        if layout.get("lora"):  # adapters on a frozen base; B starts at zero (A trains from the second step)
            from tpzoo.models.lora import LoRAConfig, add_lora, init_lora

            add_lora(chunks, LoRAConfig(4, 8.0))
            init_lora(chunks, SEED)
        opt = make_muon(chunks, dims, layout)
        clip = MaxLogits(chunks, dims, layout["qk_clip"]) if "qk_clip" in layout else None  # MuonClip
        losses, logits = [], []
        with comm.count_collectives() as counted:
            for step in range(steps):
                mbs, tokens = local_batches(cfg, step, dims, sp)
                opt.zero_grad()
                if clip is not None:
                    clip.begin()
                out = forward_backward(chunks, mbs, dims, loss_scale=1.0 / tokens)
                finalize_grads(chunks, dims)
                opt.reduce_grads()
                seen = clip.finish() if clip is not None else None
                opt.step(LR, clip_rows=seen.rows if seen is not None else None)
                losses.append(out["loss_sum"])
                logits.append(seen.max_logit if seen is not None else None)
        exchange = {k: (v.calls, v.elements) for k, v in counted.stats.items() if k[0] == "all_to_all_v"}
        with opt.weights_readable():
            params = {n: unpadded(n, _full(p, p.detach(), dims), cfg) for c in chunks for n, p in c.named_parameters()}
        parts = getattr(opt, "parts", (opt,))
        owned = sum(b - a for part in parts for a, b, _, _ in part.muon_runs)  # this rank's Muon elements
        return {"loss_sum": losses, "params": params, "exchange": exchange, "dp": dims.dp, "cp": dims.cp,
                "max_logits": logits, "muon_owned": owned}
    finally:
        if not local:
            tpzoo.destroy_parallel()


def run_layouts(layouts: list[dict]) -> list[dict]:
    return [train_layout(layout) for layout in layouts]


@functools.cache
def reference(model: str, lora: bool = False) -> dict:
    """tp 1, one process (float32 Newton-Schulz, as the layouts)."""
    return train_layout({"model": model, "lora": lora}, local=True)


def check_layout(layout: dict, ranks: list[dict]) -> None:
    ref = reference(layout["model"], layout.get("lora", False))
    rtol = RTOL.get(layout["model"], 1e-5)
    for r in ranks:
        for name, p in r["params"].items():
            want = ref["params"][name if name in ref["params"] else "embed.weight"]  # a tied head's copy at pp 2
            torch.testing.assert_close(p, want, rtol=rtol, atol=rtol * float(want.abs().max()),
                                       msg=lambda m: f"{layout} {name}: {m}")
    repeats = len(ranks) // (ranks[0]["dp"] * ranks[0]["cp"])  # tp and pp ranks report the same sum
    by_step = [sum(r["loss_sum"][s] for r in ranks) / repeats for s in range(STEPS)]
    assert by_step == pytest.approx(ref["loss_sum"], rel=1e-5), layout


# -- tp 1 against torch.optim.Muon ------------------------------------------------------------------------------

def with_lora(model):
    """LoRA adapters (rank 4) on every linear layer of `model`, B drawn non-zero so both A and B train."""
    from tpzoo.models.lora import LoRAConfig, add_lora, init_lora

    add_lora([model], LoRAConfig(4, 8.0))
    init_lora([model], SEED)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora.B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


@pytest.mark.parametrize("model", ["llama", "moe", "mla", "gdn", "kimi", "lora"])
def test_tp1_update_equals_torch_muon_per_hf_projection(model):
    """Same gradients each step (the optimizer's own reduced fp32 gradients, handed to torch too): Muon's
    matrices equal torch.optim.Muon's (bit for bit but for rare one-ulp roundings of the bf16 iteration, far below
    what another rule would change), AdamW's equal torch.optim.AdamW's to rounding. "lora": the adapters of a
    frozen llama, A and B each one matrix."""
    lora = model == "lora"
    cfg = MODELS["llama" if lora else model]
    dims = local_dims()
    ours, theirs = Transformer(cfg, dims, seed=SEED), Transformer(cfg, seed=SEED)
    if lora:
        ours, theirs = with_lora(ours), with_lora(theirs)
    opt = DistributedMuon([p for p in ours.parameters() if p.requires_grad], dims, matrices=place([ours]), **ADAM)
    assert opt.state_kinds() == (["exp_avg"] if lora else ["exp_avg", "exp_avg_sq"])
    muon, adamw, copy_grads, copy_back = torch_optimizers(theirs, cfg)
    fused = {}  # what orthogonalizing q|k|v (and gate|up) fused would do to the first update
    for step in range(1 if model == "gdn" else 2):  # the second step has momentum (gdn: its slow recurrence)
        mbs, tokens = local_batches(cfg, step, dims)
        opt.zero_grad()
        forward_backward([ours], mbs, dims, loss_scale=1.0 / tokens)
        finalize_grads([ours], dims)
        opt.reduce_grads()
        grads = {n: p.main_grad.clone() for n, p in ours.named_parameters() if p.requires_grad}
        copy_grads(grads)
        muon.step()
        if adamw is not None:
            adamw.step()
        copy_back()
        if step == 0:
            fused = _fused_first_update(theirs, cfg, grads)
        opt.step(LR)
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            if not a.requires_grad:
                assert torch.equal(a, b), name
            elif hf_projections(cfg, name, b.detach()) is not None:
                # bit for bit but for rare one-ulp roundings of the bf16 iteration, where several matrices of one
                # shape run as one batched matmul and torch runs them one by one
                diff = (a - b).detach().abs()
                ulp = LR * 0.2 * max(a.shape) ** 0.5 * 2 ** -7
                assert float(diff.max()) <= (step + 1) * ulp and float((diff == 0).float().mean()) > 0.99, \
                    (model, step, name, float(diff.max()), float((diff == 0).float().mean()))
            else:
                assert_close(a, b, f"{model} step {step} {name}")
    for name, w in fused.items():  # a test that would fail if q|k|v were orthogonalized fused
        first = dict(theirs.named_parameters())[name]
        assert (w - first).abs().max() > 1e-3, name


def _fused_first_update(model, cfg, grads: dict) -> dict:
    """The first step's fused-orthogonalization result of every fused weight (q|k|v, gate|up), from the
    parameters before that step: {name: weights after a fused update}."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    out = {}
    for name, p in model.named_parameters():
        views = hf_projections(cfg, name, p.detach()) if p.requires_grad else None
        if views is None or len(views) == 1 or p.dim() != 2:
            continue
        g = grads[name]
        update = g.lerp(g * (1 - 0.95), 0.95)  # Nesterov's first step: buf = (1 - mu) g
        o = _zeropower_via_newtonschulz(update, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        lr = LR * 0.2 * max(p.shape) ** 0.5
        out[name] = p.detach() * (1 - LR * ADAM["weight_decay"]) - lr * o.float()
    return out


# -- layouts ---------------------------------------------------------------------------------------------------

LAYOUTS = {
    2: [dict(model="llama", tp=2, sp=True, wave=3000), dict(model="llama", pp=2),
        dict(model="llama", dp=2, zero=1, wave=200), dict(model="llama", dp=2, zero=3),
        dict(model="llama", cp=2), dict(model="moe", dp=2, ep=2, zero=1),
        dict(model="mla", tp=2, sp=True), dict(model="llama", tp=2, lora=True)],
}
SLOW_LAYOUTS = {
    4: [dict(model="llama", tp=2, dp=2, sp=True, zero=z) for z in (0, 1, 2, 3)]
       + [dict(model="llama", tp=2, pp=2, sp=True), dict(model="llama", pp=2, dp=2, zero=1),
          dict(model="llama", tp=2, cp=2), dict(model="moe", tp=2, dp=2, ep=2, zero=1, sp=True),
          dict(model="mla", dp=4, ep=2, zero=2), dict(model="gdn", tp=2, dp=2, zero=1),
          dict(model="tied", pp=2, dp=2, zero=1, bucket=1 << 20)],
}


def _check_all(layouts: list[dict], results: list[list[dict]]) -> None:
    for i, layout in enumerate(layouts):
        ranks = [r[i] for r in results]
        check_layout(layout, ranks)
        calls = sum(c for r in ranks for c, _ in r["exchange"].values())
        if layout.get("tp", 1) > 1 or layout.get("zero", 0) >= 1 and layout.get("dp", 1) > 1:
            assert calls > 0, layout  # the matrices travelled, counted by tpzoo.parallel.comm
        if layout["model"] == "tied":
            assert min(r["muon_owned"] for r in ranks) == 0, layout  # a rank without Muon elements took part


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_muon_layouts_equal_one_process(world):
    results = run_on_ranks(world, run_layouts, LAYOUTS[world])
    _check_all(LAYOUTS[world], results)


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(SLOW_LAYOUTS))
def test_muon_layout_matrix_equals_one_process(world):
    results = run_on_ranks(world, run_layouts, SLOW_LAYOUTS[world])
    _check_all(SLOW_LAYOUTS[world], results)
