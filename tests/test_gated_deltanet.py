"""The Gated DeltaNet layer (models/kinds/gated_deltanet.py, token-mixer kind "gated_deltanet") against transformers' own layers, Qwen3.5's
(Qwen3_5GatedDeltaNet: in_proj_qkv / z / b / a) and Qwen3-Next's (Qwen3NextGatedDeltaNet: grouped in_proj_qkvz /
ba), tiny random fp32 weights, sequences longer than the chunk: the output, the input's gradient and every
parameter's gradient (mapped back to HF names) within 1e-5 of the largest entry, at tp 1 here and on gloo ranks
at tp 2 with and without sequence parallelism and at (tp, cp) = (2, 2) with SP (all-to-all over heads). Packed
rows with document masking equal transformers' layer run on each document alone (its gradients summed); prefill
then token-by-token decoding with the layer's cache equals the full forward, also after a packed prefill. The
comparisons can fail: A_log / dt_bias swapped, the output gate ignored, or the short conv not reset at a
document boundary each move the result far past the tolerance."""
import inspect

import pytest
import torch

import tpzoo
from tpzoo.models import AttentionConfig, Context, MLPConfig, ModelConfig, ModelLayout
from tpzoo.models.config import GatedDeltaNetConfig
from tpzoo.models.documents import Documents
from tpzoo.models.kinds.gated_deltanet_hf import gated_deltanet_tensor_maps
from tpzoo.models.kinds import gated_deltanet as gdn
from tpzoo.models.kinds.gated_deltanet import GatedDeltaNet
from tpzoo.parallel import ParallelDims, ParallelLayoutError, comm, finish_tp_grads, shard, unshard
from tpzoo.parallel.ring_attention import local_positions
from tpzoo.testing import run_on_ranks

m35 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as mnext  # noqa: E402
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig  # noqa: E402

HF_KW = dict(hidden_size=32, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
             linear_value_head_dim=4, linear_conv_kernel_dim=4, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6)
FAMILIES = {"qwen3_5": (Qwen3_5TextConfig, m35, "Qwen3_5GatedDeltaNet"),
            "qwen3_next": (Qwen3NextConfig, mnext, "Qwen3NextGatedDeltaNet")}
S = 136  # > 2 chunks; a multiple of 2 * cp * tp for the (2, 2) + SP layout
DOC_IDS = torch.tensor([[0] * 20 + [1] * 64 + [2] * 1 + [3] * 51, [0] * 100 + [1] * 36])


def assert_close(actual, expected, what: str, rtol: float = 1e-5) -> None:
    actual, expected = actual.detach(), expected.detach()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * float(expected.abs().max()),
                               msg=lambda m: f"{what}: {m}")


def max_error(actual, expected) -> float:
    """The largest difference relative to the largest expected entry (what assert_close bounds by 1e-5)."""
    return float((actual - expected).detach().abs().max() / expected.abs().max())


@pytest.fixture(autouse=True)
def _transformers_torch_path(monkeypatch):
    """transformers sends its gated-delta functions to fla when fla is installed, even for CPU tensors: the oracle
    is its torch code."""
    for mod in (m35, mnext):
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            monkeypatch.setattr(mod, name, inspect.unwrap(getattr(mod, name)))


def model_config(g: GatedDeltaNetConfig) -> ModelConfig:
    """A one-layer model config around the layer's settings (the eps and init std are the model's)."""
    return ModelConfig(family="qwen3_5", vocab_size=97, hidden_size=HF_KW["hidden_size"], num_layers=1,
                       attention=AttentionConfig(4), mlp=MLPConfig(32), gated_deltanet=g,
                       token_mixers=["gated_deltanet"], norm_eps=HF_KW["rms_norm_eps"])


def build(g: GatedDeltaNetConfig, dims, sp: bool = False) -> GatedDeltaNet:
    """The kind built on meta, materialized on the CPU and reset in registration order (as a model's
    init_weights: the layer's own A_log, dt_bias, then its children), from the current RNG state."""
    layer = GatedDeltaNet(model_config(g), 0, ModelLayout(dims, sequence_parallel=sp))
    return materialized(layer)


def materialized(layer):
    """A kind built on meta, materialized on the CPU and reset in registration order (a model's init_weights), from
    the current RNG state (shared by the Gated DeltaNet and Kimi Delta Attention layer tests)."""
    attrs = {n: dict(p.__dict__) for n, p in layer.named_parameters()}
    layer.to_empty(device="cpu")
    for n, p in layer.named_parameters():  # to_empty drops the parallel attributes (Transformer restores them)
        p.__dict__.update(attrs[n])
    for m in layer.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return layer


def from_hf_cfg(hf_cfg) -> GatedDeltaNetConfig:
    return GatedDeltaNetConfig(hf_cfg.linear_num_key_heads, hf_cfg.linear_num_value_heads,
                               hf_cfg.linear_key_head_dim, hf_cfg.linear_value_head_dim, hf_cfg.linear_conv_kernel_dim)


def hf_layer(family: str, seed: int = 0):
    """transformers' layer with every weight random (A_log and dt_bias distinct, the norm away from 1)."""
    config_cls, module, name = FAMILIES[family]
    hf_cfg = config_cls(**HF_KW)
    layer = getattr(module, name)(hf_cfg, 0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        layer.A_log.copy_(torch.rand(layer.A_log.shape, generator=g).mul(3).add(0.3).log())
        layer.norm.weight.add_(1.0)
    return layer, from_hf_cfg(hf_cfg)


def tensor_maps(cfg, family):
    return gated_deltanet_tensor_maps(cfg, "gdn", "hf", family)


def to_tpzoo(hf_tensors: dict, cfg, family) -> dict:
    """HF-named tensors (weights, or their gradients: the maps are permutations) -> tpzoo's full tensors."""
    return {m.name[4:]: m.to_tpzoo([hf_tensors[h[3:]] for h in m.hf]) for m in tensor_maps(cfg, family)}


def load(layer: GatedDeltaNet, full: dict) -> GatedDeltaNet:
    dims = layer.dims
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(shard(full[name], p.tp_spec, dims.tp_rank, dims.tp))
    return layer


def inputs(b=2, s=S, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, HF_KW["hidden_size"], generator=g), torch.randn(b, s, HF_KW["hidden_size"], generator=g)


def hf_reference(family: str, x, w, doc_ids=None) -> dict:
    """transformers' output, input gradient and tpzoo-named full parameter gradients; with doc_ids, its layer run on
    each document alone (outputs placed, gradients summed)."""
    layer, cfg = hf_layer(family)
    y, dx = run_hf_layer(layer, x, w, doc_ids)
    grads = to_tpzoo({n: p.grad for n, p in layer.named_parameters()}, cfg, family)
    return {"y": y, "dx": dx, "grads": grads, "weights": to_tpzoo(layer.state_dict(), cfg, family)}


def run_hf_layer(layer, x, w, doc_ids=None):
    """(output, input gradient) of transformers' `layer` under the loss (y * w).sum(), its parameters' gradients
    left in .grad; with doc_ids, run on each document alone (outputs placed, gradients summed).
    (tests/test_kimi_delta.py's layer too.)"""
    x = x.clone().requires_grad_()
    if doc_ids is None:
        y = layer(x)
    else:
        y = torch.zeros_like(w)
        for row in range(x.shape[0]):
            for d in doc_ids[row].unique():
                idx = (doc_ids[row] == d).nonzero().flatten()
                y = y.index_put((torch.tensor([row]), idx), layer(x[row:row + 1, idx])[0])
    (y * w).sum().backward()
    return y.detach(), x.grad


def context(docs=None) -> Context:
    return Context(0, None if docs is None else Documents(docs))


def run_ours(layer, x, w, docs=None):
    x = x.clone().requires_grad_()
    y = layer(x, context(docs))
    (y * w).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "grads": {n: p.grad for n, p in layer.named_parameters()}}


def check(got: dict, ref: dict, what: str) -> None:
    assert_close(got["y"], ref["y"], f"{what} output")
    assert_close(got["dx"], ref["dx"], f"{what} input gradient")
    assert set(got["grads"]) == set(ref["grads"])
    for name, g in got["grads"].items():
        assert_close(g, ref["grads"][name], f"{what} gradient of {name}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_equals_transformers(family):
    x, w = inputs()
    ref = hf_reference(family, x, w)
    layer = load(build(ref_cfg(family), ParallelDims.for_rank(device="cpu")), ref["weights"])
    check(run_ours(layer, x, w), ref, f"{family} tp=1")
    # the mapping round-trips bit-exact
    hf_sd = hf_layer(family)[0].state_dict()
    for m in tensor_maps(ref_cfg(family), family):
        back = m.to_hf(m.to_tpzoo([hf_sd[h[3:]] for h in m.hf]))
        assert all(torch.equal(t, hf_sd[h[3:]]) for t, h in zip(back, m.hf)), m.name


def ref_cfg(family):
    return from_hf_cfg(FAMILIES[family][0](**HF_KW))


def test_packed_equals_documents_and_the_checks_can_fail(monkeypatch):
    x, w = inputs()
    family, cfg = "qwen3_5", ref_cfg("qwen3_5")
    per_doc = hf_reference(family, x, w, DOC_IDS)
    layer = load(build(cfg, ParallelDims.for_rank(device="cpu")), per_doc["weights"])
    check(run_ours(layer, x, w, DOC_IDS), per_doc, "packed vs transformers per document")
    whole = hf_reference(family, x, w)
    y = layer(x, context())
    # A_log and dt_bias swapped (both [value heads]): the mapping mistake the tests must see
    swapped = dict(per_doc["weights"], A_log=per_doc["weights"]["dt_bias"], dt_bias=per_doc["weights"]["A_log"])
    bad = load(build(cfg, ParallelDims.for_rank(device="cpu")), swapped)
    assert max_error(bad(x, context()), whole["y"]) > 1e-2
    # the output gate ignored
    with monkeypatch.context() as mp:
        mp.setattr(gdn.GatedRMSNorm, "forward", lambda self, o, z: gdn.kernels.rms_norm(o, self.weight, self.eps))
        assert max_error(layer(x, context()), whole["y"]) > 1e-2
    # the short conv not reset at document boundaries (the recurrence still is)
    with monkeypatch.context() as mp:
        conv = gdn.causal_conv
        mp.setattr(gdn, "causal_conv", lambda x, weight, past=None, starts=None: conv(x, weight, past, None))
        assert max_error(layer(x, context(DOC_IDS)), per_doc["y"]) > 1e-3
    assert_close(y, whole["y"], "unpatched again")


def test_cache_prefill_then_decode_equals_the_full_forward():
    x, _ = inputs(b=2, s=80)
    layer, cfg = hf_layer("qwen3_5")
    full = layer(x).detach()
    ours = load(build(cfg, ParallelDims.for_rank(device="cpu")), to_tpzoo(layer.state_dict(), cfg, "qwen3_5"))
    with torch.no_grad():
        cache = ours.new_cache(2)
        steps = [ours(x[:, :70], context(), cache)] + [ours(x[:, t:t + 1], context(), cache) for t in range(70, 80)]
        assert_close(torch.cat(steps, dim=1), full, "prefill 70 + decode 10 vs the full forward")
        # a packed prefill (documents of 68 and 2 tokens), then decoding that continues the last document: the
        # state and the conv's last 3 inputs must hold that document only (its 2 tokens, not the one before)
        ids = torch.tensor([[0] * 68 + [1] * 2] * 2)
        cache = ours.new_cache(2)
        steps = [ours(x[:, :70], context(ids), cache)[:, 68:]]
        steps += [ours(x[:, t:t + 1], context(), cache) for t in range(70, 75)]
        assert_close(torch.cat(steps, dim=1), layer(x[:, 68:75]), "packed prefill + decode vs the document alone")


def test_refusals():
    cfg = ref_cfg("qwen3_5")  # 4 key heads
    with pytest.raises(ParallelLayoutError, match="tp=8 does not divide linear_num_key_heads=4"):
        GatedDeltaNet(model_config(cfg), 0, ModelLayout(ParallelDims.for_rank(tp=8, device="meta")))
    with pytest.raises(ParallelLayoutError, match="tp x cp = 2 x 4 .* use a cp that divides"):
        GatedDeltaNet(model_config(cfg), 0, ModelLayout(ParallelDims.for_rank(tp=2, cp=4, device="meta")))


# on gloo ranks (each layout against transformers' results computed here)

def _local(t, dims, sp: bool):
    """This rank's tokens of a full [b, S, ...] tensor: its cp chunks (load-balanced), then its SP part."""
    if dims.cp > 1:
        t = t.index_select(1, local_positions(t.shape[1] // (2 * dims.cp), dims.cp, dims.cp_rank, "cpu"))
    return t.chunk(dims.tp, dim=1)[dims.tp_rank] if sp else t


def _rank_cases(weights: dict, x, w, cases: list) -> list:
    out = []
    for tp, cp, sp, packed in cases:
        dims = tpzoo.init_parallel(tp=tp, cp=cp)
        try:
            torch.manual_seed(5)
            fresh = [p.detach().clone() for p in build(ref_cfg("qwen3_5"), dims, sp).parameters()]
            layer = load(build(ref_cfg("qwen3_5"), dims, sp), weights)
            xl = _local(x, dims, sp).detach().clone().requires_grad_()
            with comm.count_collectives() as counter:
                y = layer(xl, context(DOC_IDS if packed else None))
                (y * _local(w, dims, sp)).sum().backward()
            finish_tp_grads(layer, dims)  # the trainer's TP reduction: the gated norm's partial gradient summed
            res = {"y": y.detach(), "dx": xl.grad, "grads": {n: p.grad for n, p in layer.named_parameters()},
                   "fresh": fresh, "a2a": counter.get("all_to_all", "cp").calls}
            if not packed and cp == 1 and not sp:  # generation at this layout: prefill 100, decode 4
                with torch.no_grad():
                    cache = layer.new_cache(x.shape[0])
                    steps = [layer(x[:, :100], context(), cache)] + [layer(x[:, t:t + 1], context(), cache)
                                                                     for t in range(100, 104)]
                res["decoded"] = torch.cat(steps, dim=1)
            out.append(res)
        finally:
            tpzoo.destroy_parallel()
    return out


def _merge(per_rank: list, i: int, tp: int, cp: int, sp: bool) -> dict:
    specs = {n: p.tp_spec for n, p in GatedDeltaNet(model_config(ref_cfg("qwen3_5")), 0, ModelLayout(
        ParallelDims.for_rank(tp=tp, cp=cp))).named_parameters()}
    return merge_ranks(per_rank, i, tp, cp, sp, specs)


def merge_ranks(per_rank: list, i: int, tp: int, cp: int, sp: bool, specs: dict) -> dict:
    """One case's per-rank results as full tensors: outputs in sequence order, gradients summed over cp then
    unsharded over tp by the parameters' `specs` (a norm's gradient, already summed over tp by finish_tp_grads,
    equal on the tp ranks); the fresh weights unsharded. (tests/test_kimi_delta.py's layer too.)"""
    rank = lambda t, c: per_rank[c * tp + t][i]  # noqa: E731 (tp fastest)
    chunk = S // (2 * cp)
    order = torch.cat([local_positions(chunk, cp, c, "cpu") for c in range(cp)])
    merged = {}
    for key in ("y", "dx"):
        rows = torch.cat([torch.cat([rank(t, c)[key] for t in range(tp)], 1) if sp else rank(0, c)[key]
                          for c in range(cp)], dim=1)
        merged[key] = rows.index_select(1, torch.argsort(order))
    merged["grads"] = {}
    for name, spec in specs.items():
        per_tp = [sum(rank(t, c)["grads"][name] for c in range(cp)) for t in range(tp)]
        if spec.replicated:
            assert all(torch.equal(g, per_tp[0]) for g in per_tp), name
        merged["grads"][name] = per_tp[0] if spec.replicated else unshard(per_tp, spec)
    merged["fresh"] = [unshard([rank(t, 0)["fresh"][j] for t in range(tp)], spec) if not spec.replicated
                       else rank(0, 0)["fresh"][j] for j, spec in enumerate(specs.values())]
    return merged


def test_tensor_and_context_parallel_equal_transformers():
    check_layouts("qwen3_5", {2: [(2, 1, False, False), (2, 1, True, False), (2, 1, True, True)],
                              4: [(2, 2, True, False), (2, 2, True, True)]})


@pytest.mark.slow
def test_more_layouts_and_qwen3_next():
    check_layouts("qwen3_next", {2: [(2, 1, True, True), (1, 2, False, True)],
                                 4: [(2, 2, False, False), (2, 2, False, True), (1, 4, False, True)]})


def check_layouts(family: str, layouts: dict) -> None:
    """(tp, cp, sp, packed) cases per world size, each against transformers' results for `family`'s weights (the
    tpzoo layer is the same for both families: only the HF names differ)."""
    x, w = inputs()
    refs = {False: hf_reference(family, x, w), True: hf_reference(family, x, w, DOC_IDS)}
    weights = refs[False]["weights"]
    torch.manual_seed(5)
    fresh = [p.detach() for p in build(ref_cfg("qwen3_5"), ParallelDims.for_rank(device="cpu")).parameters()]
    check_rank_results(layouts, _rank_cases, _merge, check, weights, x, w, refs, fresh)


def check_rank_results(layouts: dict, rank_cases, merge, check, weights, x, w, refs: dict, fresh: list) -> None:
    """Run each world size's (tp, cp, sp, packed) cases on ranks (`rank_cases`), merge each case's shards
    (`merge`) and `check` them against refs[packed]: also the same fresh weights at every layout, the cp all-to-alls
    (the projections to heads and the output back, forward and backward) and prefill + decode = the full forward.
    Shared by the Gated DeltaNet and Kimi Delta Attention layer tests."""
    for world, cases in layouts.items():
        per_rank = run_on_ranks(world, rank_cases, weights, x, w, cases)
        for i, (tp, cp, sp, packed) in enumerate(cases):
            what = f"tp={tp} cp={cp} sp={sp} packed={packed}"
            merged = merge(per_rank, i, tp, cp, sp)
            check(merged, refs[packed], what)
            for a, b in zip(merged["fresh"], fresh):  # one seed, the same full weights at every layout
                assert torch.equal(a, b), what
            if cp > 1:
                assert all(r[i]["a2a"] == 4 for r in per_rank), what
            if "decoded" in per_rank[0][i]:  # causal: the first 104 outputs of the full forward
                assert_close(per_rank[0][i]["decoded"], refs[False]["y"][:, :104], f"{what} prefill + decode")
