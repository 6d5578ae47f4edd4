"""Training DeepSeek Sparse Attention (tests/dsa_models.py: tiny random DeepSeek-V3.2 and GLM-5 written by
transformers, index_topk 5 below the 12-token sequences) against one process:

- three SGD steps at tp 2 + SP, pp 2 and cp 2 on 2 gloo ranks (one pool call) equal the single-process model on the
  same micro-batches: the loss of every step, every gradient of the first step and every parameter after the last,
  within 1e-5 of each tensor's largest entry. DeepSeek-V3.2 trains its indexers with the KL loss
  (--dsa-indexer-loss-scale; the dense target at tp 2 + SP and cp 2, the sparse one at pp 2): the indexers' gradients
  come from the KL alone, its target summed over the heads of every tp rank, its queries split over tp (SP) or cp;
  the logged indexer loss equals one process's. GLM-5 (slow) keeps its indexers frozen (the default): they never
  change, their layers' shared top-k included.
- the KL is DeepSeek-V3.2's L_I: transformers' own attention probabilities (eager, output_attentions: the sparse
  mask applied) and its indexer's scores give the loss tpzoo reports (sparse variant), 1e-5;
- the KL in blocks of query rows (recomputed in the backward) equals it whole (the CLI's logging and the frozen
  default: tests/test_dsa_cli.py).
- top-k: ties at the k-th score go to the earliest keys, at every size.
tp 2 + SP and cp 2 train in float64 (the indexer's scores stay fp32, as HF's). In fp32 the first step's gradients
agree within 4e-6 of each tensor's largest entry (DeepSeek-V3.2, measured), but after three steps a few weights of both
families drift past 1e-5 (2 of 576 entries of a q_b_proj, 1.5e-4 relative, at tp 2 + SP; GLM-5 with its indexers
frozen too): the selection is discrete, and the layouts' different rounding can reorder near-tied keys."""
import dataclasses

import pytest
import torch
from dsa_models import TOPK, VOCAB, make_hf_model
from test_3d_parity import assert_close
from test_frontier_training import _unpadded
from test_moe_training import _full

import tpzoo
from tpzoo.checkpoint import load_weights_into
from tpzoo.models import Inputs, ModelLayout, Transformer, from_hf_config
from tpzoo.parallel import GradBuffer, grad_of
from tpzoo.parallel.context_parallel import shard_batch
from tpzoo.pipeline import build_model_chunks, finalize_grads, forward_backward
from tpzoo.testing import run_on_ranks

GLOBAL_BATCH, SEQ, STEPS, SCALE = 2, 12, 3, 0.5
LAYOUTS = [dict(tp=2, sp=True, dtype=torch.float64), dict(pp=2, sparse=True), dict(cp=2, dtype=torch.float64)]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for kind in ("deepseek_v32", "glm_moe_dsa"):
        path = tmp_path_factory.mktemp(kind)
        make_hf_model(kind).save_pretrained(path)
        out[kind] = str(path)
    return out


def config(path: str, kind: str, sparse: bool = False):
    cfg = from_hf_config(path)
    scale = SCALE if kind == "deepseek_v32" else 0.0  # GLM-5: the indexers frozen (the default)
    return cfg.replace(sparse_mla=dataclasses.replace(cfg.sparse_mla, indexer_loss_scale=scale, sparse_loss=sparse))


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def global_batch(step: int):
    g = torch.Generator().manual_seed(70 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((GLOBAL_BATCH, 1), -100)], dim=1)
    labels[torch.rand(labels.shape, generator=g) < 0.15] = -100
    return ids, labels


def reference(path: str, kind: str, dtype=torch.float32, sparse: bool = False) -> dict:
    """One process, micro-batches of one sequence (as every layout below runs them)."""
    model = Transformer(config(path, kind, sparse), ModelLayout(dtype=dtype))
    load_weights_into(model, path)
    model.train()
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    losses, grads, reports = [], {}, []
    for step in range(STEPS):
        ids, labels = global_batch(step)
        tokens = (labels != -100).sum()
        opt.zero_grad(set_to_none=True)
        total, report = 0.0, 0.0
        for i in range(GLOBAL_BATCH):
            per_token = model(Inputs(ids[i:i + 1], labels=labels[i:i + 1]))
            (per_token.sum() / tokens).backward()
            total += per_token.sum().item()
            report += model.aux_reports.get("dsa_indexer_loss", torch.tensor(0.0)).item() * (
                labels[i] != -100).sum().item()
        losses.append(total)
        reports.append(report)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
    return {"loss_sum": losses, "grads": grads, "reports": reports,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def train(path: str, kind: str, layout: dict) -> dict:
    dims = tpzoo.init_parallel(tp=layout.get("tp", 1), pp=layout.get("pp", 1), cp=layout.get("cp", 1))
    try:
        chunks = build_model_chunks(config(path, kind, layout.get("sparse", False)), dims,
                                    sequence_parallel=layout.get("sp", False),
                                    dtype=layout.get("dtype", torch.float32))
        load_weights_into(chunks, path)
        for c in chunks:
            c.train()
        params = [p for p in {id(p): p for c in chunks for p in c.parameters()}.values() if p.requires_grad]
        buf = GradBuffer(params, device=dims.device)
        opt = make_optimizer(params)
        losses, grads, reports = [], {}, []
        for step in range(STEPS):
            ids, labels = global_batch(step)
            mbs = [shard_batch({"input_ids": ids[i:i + 1], "labels": labels[i:i + 1]}, dims, layout.get("sp", False))
                   for i in range(GLOBAL_BATCH)]
            buf.zero()
            out = forward_backward(chunks, mbs, dims, loss_scale=1.0 / int((labels != -100).sum()))
            finalize_grads(chunks, dims)
            buf.reduce(dims.grad_group)
            for p in params:
                p.grad = p.main_grad.to(p.dtype)
            losses.append(out["loss_sum"])
            reports.append(out["reports"].get("dsa_indexer_loss", 0.0))
            if step == 0:
                grads = {n: _full(p, grad_of(p), dims) for c in chunks for n, p in c.named_parameters()
                         if p.requires_grad}
            opt.step()
        return {"coords": (dims.tp_rank, dims.pp_rank, dims.cp_rank), "loss_sum": losses, "grads": grads,
                "reports": reports,
                "params": {n: _full(p, p.detach(), dims) for c in chunks for n, p in c.named_parameters()}}
    finally:
        tpzoo.destroy_parallel()


def run_all(jobs):
    return [train(*job) for job in jobs]


def check(ref: dict, ranks: list[dict], what) -> None:
    for r in ranks:
        for name, g in r["grads"].items():
            want = ref["grads"][name]
            assert_close(_unpadded(name, g).to(want.dtype), want, f"{what} rank {r['coords']} grad {name}")
        for name, p in r["params"].items():
            assert_close(_unpadded(name, p), ref["params"][name], f"{what} rank {r['coords']} param {name}")
    for step, ref_loss in enumerate(ref["loss_sum"]):
        for pp_rank in {r["coords"][1] for r in ranks}:
            # the loss sum of a cp rank is its own tokens'; the reports are every token's (the trainer sums both
            # over dp x cp), so cp ranks add up
            mine = [r for r in ranks if r["coords"][:2] == (0, pp_rank)]
            total = sum(r["loss_sum"][step] for r in mine)
            assert abs(total - ref_loss) <= 1e-5 * abs(ref_loss), (what, step, total, ref_loss)
            report = sum(r["reports"][step] for r in mine)
            assert abs(report - ref["reports"][step]) <= 1e-5 * max(1.0, abs(ref["reports"][step])), \
                (what, step, report, ref["reports"][step])


def _run(hf_dirs, kinds):
    jobs = [(hf_dirs[k], k, layout) for k in kinds for layout in LAYOUTS]
    per_rank = run_on_ranks(2, run_all, jobs)
    for j, (path, k, layout) in enumerate(jobs):
        ref = reference(path, k, layout.get("dtype", torch.float32), layout.get("sparse", False))
        check(ref, [r[j] for r in per_rank], (k, layout))
    return ref


def test_deepseek_v32_trains_its_indexers_like_one_process(hf_dirs):
    ref = _run(hf_dirs, ["deepseek_v32"])
    assert all(r > 0 for r in ref["reports"])  # the KL was computed and logged
    assert any(n.startswith("layers.1.attn.indexer.") for n in ref["grads"])  # and the indexers train


@pytest.mark.slow
def test_glm5_with_frozen_indexers_trains_like_one_process(hf_dirs):
    ref = _run(hf_dirs, ["glm_moe_dsa"])
    start = Transformer(config(hf_dirs["glm_moe_dsa"], "glm_moe_dsa"), ModelLayout())
    load_weights_into(start, hf_dirs["glm_moe_dsa"])
    indexer = [n for n in ref["params"] if ".indexer." in n]
    assert indexer and all(torch.equal(ref["params"][n], start.state_dict()[n]) for n in indexer)
    assert not any(".indexer." in n for n in ref["grads"])


# -- the KL is DeepSeek-V3.2's L_I ---------------------------------------------------------------------------------

def _hf_indexer_kl(model, ids) -> float:
    """Mean over layers and queries of KL(p || softmax(I)) over each query's selected keys, from transformers' own
    modules: p its eager attention's probabilities (the sparse mask applied) summed over the heads, I its indexer's
    scores (recomputed from the indexer's layers as DeepseekV32Indexer scores them)."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

    model.config._attn_implementation = "eager"
    captured = {}

    def scores_of(module, args, kwargs):
        h, q_resid, (cos, sin) = args[0], args[1], args[2]
        ix = module
        q = ix.wq_b(q_resid).view(*h.shape[:2], ix.n_heads, ix.head_dim)
        k = ix.k_norm(ix.wk(h)).unsqueeze(2)
        q_rot, q_pass = q.split([ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
        k_rot, k_pass = k.split([ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
        q_rot, k_rot = hf.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        s = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale)
        w = ix.weights_proj(h).float() * ix.n_heads ** -0.5
        captured.setdefault("scores", []).append(torch.matmul(w.unsqueeze(-2), s).squeeze(-2))

    hooks = [layer.self_attn.indexer.register_forward_pre_hook(scores_of, with_kwargs=True)
             for layer in model.model.layers]
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    for h in hooks:
        h.remove()
    kls = []
    for probs, scores in zip(out.attentions, captured["scores"]):
        p = probs.sum(dim=1)
        selected = p > 0
        p = p / p.sum(dim=-1, keepdim=True)
        logq = torch.log_softmax(scores.masked_fill(~selected, float("-inf")), dim=-1)
        kl = torch.where(selected, p * (torch.log(p.clamp_min(1e-10)) - logq), 0.0).sum(-1)
        kls.append(kl.mean())
    return torch.stack(kls).mean().item()


def test_indexer_loss_is_deepseeks_l_i(hf_dirs):
    model = make_hf_model("deepseek_v32")
    ids, labels = global_batch(0)
    ours = Transformer(config(hf_dirs["deepseek_v32"], "deepseek_v32", sparse=True), ModelLayout())
    load_weights_into(ours, hf_dirs["deepseek_v32"])
    ours.train()
    ours(Inputs(ids, labels=labels))
    assert abs(ours.aux_reports["dsa_indexer_loss"].item() - _hf_indexer_kl(model, ids)) < 1e-5


def test_indexer_loss_in_blocks_equals_it_whole(hf_dirs, monkeypatch):
    """trained_kl's blocks of query rows (each recomputed in its backward) give the KL and the indexers' gradients
    of the whole score tensor, also with counted rows (a token mask)."""
    from tpzoo.models.kinds import sparse_mla_indexer

    ids, labels = global_batch(0)
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(9)) < 0.7
    out = []
    for block in (1 << 24, 2 * 8 * SEQ * 2):  # every row at once; 2 rows of 12 keys x 8 heads x 2 sequences
        monkeypatch.setattr(sparse_mla_indexer, "BLOCK", block)
        model = Transformer(config(hf_dirs["deepseek_v32"], "deepseek_v32"), ModelLayout(dtype=torch.float64))
        load_weights_into(model, hf_dirs["deepseek_v32"])
        model.train()
        model(Inputs(ids, labels=labels, token_mask=mask)).sum().backward()  # (the KL rides on the per-token loss)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if ".indexer." in n}
        out.append((model.aux_reports["dsa_indexer_loss"].item(), grads))
    (whole, g_whole), (blocked, g_blocked) = out
    assert blocked == pytest.approx(whole, rel=1e-6, abs=0) and whole > 0  # (the scores are fp32, as HF's)
    assert g_whole and g_whole.keys() == g_blocked.keys()
    for n, g in g_whole.items():
        assert_close(g_blocked[n], g, n)


def test_lora_leaves_the_indexers_without_adapters(hf_dirs):
    """`--lora-rank` (all-linear) adapts MLA's and the experts' projections, not the indexers' (they learn from their
    KL alone, which a LoRA run refuses): no dead adapters, none exported to PEFT."""
    from tpzoo.models.lora import LoRAConfig, add_lora, valid_targets

    model = Transformer(config(hf_dirs["deepseek_v32"], "deepseek_v32"), ModelLayout())
    add_lora([model], LoRAConfig(4, 8.0))
    adapted = {n.split(".lora.")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert "layers.1.attn.q_b_proj" in adapted and not any(".indexer." in n for n in adapted)
    assert not {"wq_b", "wk", "weights_proj"} & set(valid_targets(model))


def test_topk_ties_go_to_the_earliest_keys():
    from tpzoo.models.kinds.sparse_mla_indexer import topk_mask

    for keys in (7, 300):
        scores = torch.zeros(2, 3, keys)
        scores[0, :, keys - 1] = 1.0  # one clear winner, then ties
        visible = torch.ones(1, 3, keys, dtype=torch.bool)
        visible[..., 1] = False  # a hidden key is never chosen
        mask = topk_mask(scores, visible, TOPK)
        assert mask.sum(-1).eq(TOPK).all()
        assert mask[0, 0].nonzero().flatten().tolist() == [0, 2, 3, 4, keys - 1]
        assert mask[1, 0].nonzero().flatten().tolist() == [0, 2, 3, 4, 5]
    few = topk_mask(torch.randn(1, 4, 4), torch.ones(4, 4, dtype=torch.bool).tril().unsqueeze(0), TOPK)
    assert torch.equal(few[0], torch.ones(4, 4, dtype=torch.bool).tril())  # fewer keys than k: all it sees
