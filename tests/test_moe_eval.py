"""Evaluation of a mixture of experts: `loss` (and `perplexity`) is the language model's alone, equal to
transformers' causal-LM cross-entropy computed from its logits, although the tiny Mixtral and Qwen3-MoE train
with the load-balancing loss (output_router_logits, coefficient 0.02); `router_aux_loss` equals transformers'
aux_loss and `router_z_loss` the ST-MoE z-loss of its router logits, each a mean over forwards weighted by the
forward's predicted tokens. Layouts: (tp, ep) = (1, 2) and (2, 1) with sequence parallelism on 4 ranks (the short
last window padded to a multiple of tp: the padding must not enter the router statistics), and on 8 ranks
(tp, pp, ep, dp) = (2, 2, 2, 2) + SP and (tp, cp, pp, ep, dp) = (1, 2, 2, 2, 2) (Qwen3-MoE's stage 0 holds only its
dense layer: the statistics travel through the pipeline). The routers are drawn large, so routing is uneven."""
import math

import pytest
import torch
import torch.nn.functional as F

import tpzoo
from tpzoo.checkpoint import load_model
from tpzoo.models import LossOptions
from tpzoo.evaluation import batches, evaluate, token_windows
from tpzoo.pipeline import forward_backward
from tpzoo.testing import run_on_ranks

from test_moe_hf_parity import make_hf_moe

SEQ, BATCH = 8, 2
LAYOUTS_4 = [dict(tp=1, ep=2), dict(tp=2, ep=1, sp=True)]
LAYOUTS_8 = [dict(tp=2, pp=2, ep=2, sp=True), dict(tp=1, cp=2, pp=2, ep=2)]


def _hf_reference(model, stream) -> dict:
    """transformers, one forward per evaluation batch: the cross-entropy summed from its logits, its aux_loss
    and the z-loss of its router logits (mean logsumexp^2 per layer, summed over layers), weighted by tokens."""
    ce = aux = z = 0.0
    n = 0
    for i, b in enumerate(batches(token_windows(stream, SEQ), BATCH)):
        with torch.no_grad():
            out = model(input_ids=b[:, :-1], output_router_logits=True)
        tokens = b[:, 1:].numel()
        ce += F.cross_entropy(out.logits.flatten(0, 1).float(), b[:, 1:].flatten(), reduction="sum").item()
        aux += out.aux_loss.item() * tokens
        z += sum(torch.logsumexp(r.float(), dim=-1).square().mean() for r in out.router_logits).item() * tokens
        n += tokens
        if i == 0:  # transformers' training loss of this forward: CE + router_aux_loss_coef * aux_loss
            lm_loss, train_loss = ce / n, ce / n + model.config.router_aux_loss_coef * out.aux_loss.item()
    return {"tokens": n, "loss": ce / n, "router_aux_loss": aux / n, "router_z_loss": z / n,
            "train_loss": train_loss, "lm_loss": lm_loss}


def _eval_layouts(path, stream, layouts):
    out = []
    for layout in layouts:
        dims = tpzoo.init_parallel(tp=layout["tp"], pp=layout.get("pp", 1), cp=layout.get("cp", 1), ep=layout["ep"])
        try:
            model = load_model(path, sequence_parallel=layout.get("sp", False)).eval()
            result = evaluate(model, stream, SEQ, batch_size=BATCH)
            if dims.pp == dims.cp == 1:
                # The executor's training loss (aux_losses, the default) still includes the router loss; the
                # held-out loss (aux_losses=False) does not. Every rank runs the first batch.
                first = batches(token_windows(stream, SEQ), BATCH)[0]
                batch = {"input_ids": first[:, :-1], "labels": first[:, 1:]}
                with torch.no_grad():
                    result["train_loss"], result["lm_loss"] = (
                        forward_backward([model], [batch], forward_only=True,
                                         loss=LossOptions(aux_losses=flag))["loss_sum"]
                        / first[:, 1:].numel() for flag in (True, False))
            out.append(result)
        finally:
            tpzoo.destroy_parallel()
    return out


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    # 5 full windows (batches of 2, 2, 1) and a short one of 3 predictions (padded under SP at tp = 2)
    stream = torch.randint(0, 101, (5 * SEQ + 4,), generator=torch.Generator().manual_seed(5))
    out = {}
    for kind in ("mixtral", "qwen3_moe"):
        path = tmp_path_factory.mktemp(kind)
        model = make_hf_moe(kind)
        model.save_pretrained(path)
        out[kind] = (str(path), _hf_reference(model, stream), model.config.router_aux_loss_coef)
    return stream, out


@pytest.mark.parametrize("ranks,layouts", [(4, LAYOUTS_4), (8, LAYOUTS_8)], ids=["4ranks", "8ranks"])
def test_moe_eval_loss_is_the_language_model_loss(hf_moe, ranks, layouts):
    stream, models = hf_moe
    for kind, (path, ref, coef) in models.items():
        results = run_on_ranks(ranks, _eval_layouts, path, stream, layouts)
        for layout, result in zip(layouts, results[0]):
            where = f"{kind} {layout}"
            assert all(r[layouts.index(layout)] == result for r in results), where  # every rank reports the same
            assert result["tokens"] == ref["tokens"] == 5 * SEQ + 3, where
            # 1e-5: the router loss (coef * aux, about 1e-2 here) would be 1e-3 of the loss
            assert math.isclose(result["loss"], ref["loss"], rel_tol=1e-5), (where, result, ref)
            assert abs(coef * ref["router_aux_loss"]) > 1e-3 * ref["loss"]
            assert math.isclose(result["perplexity"], math.exp(ref["loss"]), rel_tol=1e-5), where
            assert math.isclose(result["router_aux_loss"], ref["router_aux_loss"], rel_tol=1e-5), (where, result, ref)
            assert math.isclose(result["router_z_loss"], ref["router_z_loss"], rel_tol=1e-5), (where, result, ref)
            if "train_loss" in result:  # training's loss on the first batch: CE + coef * aux, as transformers'
                assert math.isclose(result["train_loss"], ref["train_loss"], rel_tol=1e-5), (where, result, ref)
                assert math.isclose(result["lm_loss"], ref["lm_loss"], rel_tol=1e-5), (where, result, ref)
