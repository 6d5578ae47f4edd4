"""LoRA on the routed experts (--lora-experts, models/kinds/expert_lora.py) trained at every parallel layout against
one process, in float64 (in fp32 the summation order of the layouts' small, cancelling gradients of the attention
adapters differs by 1e-5 of their largest entry; in float64 only the routers' softmax, float32 by design, rounds:
the first step's gradients agree to ~1e-7, the adapters after three steps to ~2e-5, checked at 1e-4): three SGD
steps of a LoRA model (all-linear + one adapter per expert, B drawn non-zero so every
adapter gets a gradient from the first step) on a frozen base, a tiny Qwen3-MoE transformers wrote (layer 0 dense,
layer 1 8 experts top-2, routers drawn large: uneven routing), at ep 2 (dp 2), tp 2 + SP and pp 2 (a dense stage
0) on 2 gloo ranks in one pool call: the loss of every step and every adapter gradient of the first step (tp shards
and ep experts gathered) equal the single process within 1e-5 (of each tensor's largest entry), every adapter after
the last step within 1e-4; the layouts run the grouped matmuls (experts.GroupedLinear through grouped_mm_reference), the
single process the loop. The base stays bit for bit as loaded on every rank; the adapters of the experts that no
token reached in the whole run keep their initial values bit for bit (there are some), the others move.
Slow: DeepSeek-V3 (shared experts, a dense first layer, the sigmoid router) and gpt-oss (expert biases, the clamped
SwiGLU) at the same layouts and cp 2."""
import pytest
import torch
from test_3d_parity import assert_close
from test_moe_training import ExpertGrads, _full

import tpzoo
from tpzoo.checkpoint import load_weights_into, save_model_shards
from tpzoo.checkpoint.lora_io import lora_metadata
from tpzoo.models import Inputs, ModelLayout, Transformer, from_hf_config
from tpzoo.models.lora import LoRAConfig, add_lora, init_lora
from tpzoo.parallel import grad_of
from tpzoo.parallel.lora import is_lora_param
from tpzoo.pipeline import build_model_chunks
from tpzoo.testing import run_on_ranks

BATCH, SEQ, STEPS = 4, 8, 3
LAYOUTS = [dict(ep=2, dp=2), dict(tp=2, sp=True), dict(pp=2)]
LCFG = LoRAConfig(4, 8.0, experts=True)
DEAD = 2  # an expert no token reaches (_hf_dir)


def _hf_dir(tmp_path_factory, kind: str) -> str:
    """The tiny model, with expert DEAD never chosen: every embedding's coordinate 0 is large (the residual stream
    keeps it positive) and DEAD's router weight on it very negative (its selection bias, router bias too)."""
    path = tmp_path_factory.mktemp(kind)
    if kind == "qwen3_moe":
        from test_moe_hf_parity import make_hf_moe

        model = make_hf_moe(kind)
    else:
        from frontier_models import make_hf_model

        model = make_hf_model(kind)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 3.0
        for name, p in model.named_parameters():
            if name.endswith((".gate.weight", ".router.weight")):
                p[DEAD, 0] = -30.0
            elif name.endswith(".router.bias"):
                p[DEAD] = -100.0
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b[DEAD] = -10.0
    model.save_pretrained(path)
    return str(path)


def batch(step: int, vocab: int):
    g = torch.Generator().manual_seed(90 + step)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    return ids, labels


def optimizer(params):
    # SGD with momentum, no weight decay: an adapter with no gradient does not move
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(base: str, adapters: str, dtype) -> dict:
    """One process: the LoRA model written to `adapters` (random B), three steps on micro-batches of one
    sequence; the experts each MoE layer routed any row to, over the whole run."""
    cfg = from_hf_config(base)
    model = Transformer(cfg, ModelLayout(dtype=dtype))
    load_weights_into(model, base)
    add_lora([model], LCFG)
    init_lora([model], 0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora.B." in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1)
    save_model_shards(model, adapters, cfg, select=is_lora_param, metadata=lora_metadata(LCFG, base))
    routed = {}
    for name, layer in model.layers.items():
        if layer.mlp.kind == "moe":
            routed[name] = torch.zeros(cfg.moe.num_experts, dtype=torch.long)
            layer.mlp._dispatch_compute_return = _counting(layer.mlp, routed[name])
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params)
    losses, grads = [], {}
    for step in range(STEPS):
        ids, labels = batch(step, cfg.vocab_size)
        tokens = (labels != -100).sum()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(BATCH):
            per_token = model(Inputs(ids[i:i + 1], labels=labels[i:i + 1]))
            (per_token.sum() / tokens).backward()
            total += per_token.sum().item()
        losses.append(total)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
    return {"loss_sum": losses, "grads": grads, "routed": routed, "initial": initial,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _counting(moe, counts):
    compute = moe._dispatch_compute_return

    def counted(tokens, expert_of):
        counts.add_(torch.bincount(expert_of, minlength=counts.numel()))
        return compute(tokens, expert_of)
    return counted


def train(base: str, adapters: str, layout: dict, dtype) -> dict:
    dims = tpzoo.init_parallel(tp=layout.get("tp", 1), pp=layout.get("pp", 1), dp=layout.get("dp", 1),
                               ep=layout.get("ep", 1), cp=layout.get("cp", 1))
    try:
        cfg = from_hf_config(base)
        chunks = build_model_chunks(cfg, dims, sequence_parallel=layout.get("sp", False), dtype=dtype)
        load_weights_into(chunks, base)
        add_lora(chunks, LCFG)
        load_weights_into(chunks, adapters, select=is_lora_param)
        for c in chunks:
            c.train()
            for layer in c.layers.values():
                if layer.mlp.kind == "moe":
                    layer.mlp.expert_gemm = "grouped"  # (the single process runs the loop)
        named = {n: p for c in chunks for n, p in c.named_parameters()}
        base_before = {n: p.detach().clone() for n, p in named.items() if not p.requires_grad}
        params = [p for p in named.values() if p.requires_grad]
        reducer = ExpertGrads(params, dims)  # (the frozen base: no buffer, no gradient)
        opt = optimizer(params)
        losses, grads = [], {}
        for step in range(STEPS):
            ids, labels = batch(step, cfg.vocab_size)
            out = reducer.step(chunks, ids, labels, layout.get("sp", False))
            losses.append(out["loss_sum"])
            if step == 0:
                grads = {n: _full(p, grad_of(p), dims) for n, p in named.items() if p.requires_grad}
            opt.step()
        assert all(torch.equal(named[n], before) for n, before in base_before.items())  # the frozen base
        return {"coords": (dims.tp_rank, dims.pp_rank, dims.dp_rank), "loss_sum": losses, "grads": grads,
                "params": {n: _full(p, p.detach(), dims) for n, p in named.items() if p.requires_grad}}
    finally:
        tpzoo.destroy_parallel()


def run_all(jobs):
    return [train(*job) for job in jobs]


def _unmoved_experts(ref: dict) -> list[tuple[str, int]]:
    """(layer, expert) pairs no token reached in the whole reference run."""
    return [(layer, e) for layer, counts in ref["routed"].items() for e in range(counts.numel()) if counts[e] == 0]


def check(ref: dict, ranks: list[dict], what) -> None:
    unmoved = _unmoved_experts(ref)
    for r in ranks:
        for name, g in r["grads"].items():
            assert_close(g.to(ref["grads"][name].dtype), ref["grads"][name], f"{what} {r['coords']} grad {name}")
        for name, p in r["params"].items():  # (1e-4: three steps grow the routers' float32 rounding, see above)
            want = ref["params"][name]
            torch.testing.assert_close(p, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()),
                                       msg=lambda m: f"{what} {r['coords']} {name}: {m}")
            if ".mlp.lora." in name:  # an expert no token reached: its adapters exactly as they started
                for layer, e in unmoved:
                    if name.startswith(f"layers.{layer}."):
                        assert torch.equal(p[e], ref["initial"][name][e]), (what, name, e)
    for step, ref_loss in enumerate(ref["loss_sum"]):
        for pp_rank in {r["coords"][1] for r in ranks}:
            total = sum(r["loss_sum"][step] for r in ranks if r["coords"][:2] == (0, pp_rank))
            assert abs(total - ref_loss) <= 1e-5 * abs(ref_loss), (what, step, total, ref_loss)


def _run(tmp_path_factory, kinds, layouts):
    dirs = {k: _hf_dir(tmp_path_factory, k) for k in kinds}
    dtypes = {k: torch.float64 for k in kinds}
    refs = {}
    for k in kinds:
        adapters = tmp_path_factory.mktemp(f"{k}_adapters")
        refs[k] = reference(dirs[k], str(adapters), dtypes[k])
        refs[k]["adapters"] = str(adapters)
        unmoved = _unmoved_experts(refs[k])
        assert unmoved, f"{k}: every expert received a token; the untouched-adapter check would be empty"
        for name, p in refs[k]["params"].items():  # the single process itself: unmoved exactly, others moved
            if ".mlp.lora." in name:
                layer = name.split(".")[1]
                for e in range(p.shape[0]):
                    same = torch.equal(p[e], refs[k]["initial"][name][e])
                    assert same == ((layer, e) in unmoved), (k, name, e)
    jobs = [(dirs[k], refs[k]["adapters"], layout, dtypes[k]) for k in kinds for layout in layouts]
    per_rank = run_on_ranks(2, run_all, jobs)
    for j, (_, _, layout, _) in enumerate(jobs):
        check(refs[kinds[j // len(layouts)]], [r[j] for r in per_rank], (kinds[j // len(layouts)], layout))


def test_expert_adapters_train_like_one_process_at_ep_tp_sp_and_pp(tmp_path_factory):
    _run(tmp_path_factory, ["qwen3_moe"], LAYOUTS)


@pytest.mark.slow
def test_expert_adapters_of_deepseek_and_gpt_oss_train_like_one_process(tmp_path_factory):
    _run(tmp_path_factory, ["deepseek_v3", "gpt_oss"], LAYOUTS + [dict(cp=2)])
