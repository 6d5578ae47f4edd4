"""Activation recomputation (none | selective | full): fewer saved activations, the same loss and gradients at
any layout and schedule (zero-bubble included: its W pass walks the recomputed graph a second time), and the
extra communication of full recomputation (part of the forward's TP collectives run again)."""
import pytest
import torch

from tpzoo.models import Inputs, Transformer, apply_recompute, get_config
from tpzoo.testing import run_on_ranks

from test_3d_parity import MODELS, References, check_layout, reference, run_layouts
from test_sequence_parallel import layer_collectives


def _saved_bytes(cfg, recompute: str) -> int:
    """Bytes autograd keeps for the backward outside recomputed regions (what recomputation saves)."""
    model = apply_recompute(Transformer(cfg), recompute)
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(Inputs(ids, labels=ids)).sum()
    loss.backward()
    return total


def test_recomputation_saves_activations():
    cfg = get_config("nano-llama").replace(num_layers=4)
    none, selective, full = (_saved_bytes(cfg, mode) for mode in ("none", "selective", "full"))
    assert none > selective > full
    assert full < none / 4  # full keeps little more than each layer's input


def test_recomputation_leaves_single_process_gradients_unchanged():
    cfg = MODELS["llama"]
    ref = reference(cfg, steps=1)
    for mode in ("selective", "full"):
        got = reference(cfg, steps=1, recompute=mode)
        assert got["loss_sum"] == pytest.approx(ref["loss_sum"], rel=1e-6)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()))


LAYOUTS = {
    2: [dict(tp=2, sp=True, recompute="full"), dict(tp=1, pp=2, schedule="zb", recompute="full"),
        dict(tp=1, pp=2, schedule="interleaved", v=2, recompute="selective")],
    4: [dict(tp=2, pp=2, sp=True, schedule="zb", recompute="full"),
        dict(tp=2, pp=2, sp=True, schedule="zb", recompute="selective"),
        dict(tp=2, pp=2, sp=True, schedule="1f1b", recompute="full"),
        dict(tp=1, pp=4, schedule="interleaved", v=2, recompute="full"),
        dict(tp=2, dp=2, sp=True, schedule="gpipe", recompute="selective"),
        # tp=4: the column layers re-gather their SP input shards in backward, also inside recomputed regions
        dict(tp=4, sp=True, recompute="full"), dict(tp=4, sp=True, recompute="selective")],
}


@pytest.fixture(scope="module")
def references():
    return References(lambda cfg: reference(cfg, steps=2))


# Default tier: the Llama at 4 ranks, whose layouts hold every schedule and both modes under TP + SP (tp=4 re-gathers
# included); the GPT and the 2-rank layouts in the slow tier.
@pytest.mark.parametrize("model,world", [("llama", 4)] + [pytest.param(m, w, marks=pytest.mark.slow)
                                                          for m, w in (("gpt", 2), ("gpt", 4), ("llama", 2))])
def test_recomputation_at_every_layout_matches_one_process(references, model, world):
    layouts = [dict(layout, steps=2) for layout in LAYOUTS[world]]
    per_rank = run_on_ranks(world, run_layouts, model, layouts)
    for i, layout in enumerate(layouts):
        check_layout(MODELS[model], references[model], [r[i] for r in per_rank], layout)


def test_full_recomputation_replays_the_forward_collectives():
    cfg = get_config("nano-llama").replace(num_layers=3)
    L, tp = cfg.num_layers, 2
    calls = {mode: run_on_ranks(4, layer_collectives, cfg, tp, False, mode)[0]["all_reduce"][0]
             for mode in ("none", "selective", "full")}
    # Selective recomputes only attention's core: no collectives. Full reruns the layer's forward, but torch's
    # non-reentrant checkpoint stops as soon as the last saved activation is rebuilt (the input of the MLP's
    # output matmul), so of the layer's 2 forward all-reduces only the attention one runs again.
    assert calls == {"none": 4 * L, "selective": 4 * L, "full": 5 * L}
