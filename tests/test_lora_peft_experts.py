"""Expert adapters in from Hugging Face PEFT (the oracle), for every mixture-of-experts family: an adapter PEFT 0.21
made on transformers' model (`get_peft_model` with target_parameters mlp.experts.gate_up_proj / down_proj, o_proj
in target_modules, and on DeepSeek-V3 / GLM-4.5 the dense and shared MLPs' weights as parameters, every lora_A and
lora_B drawn at random), saved by PEFT, read with --lora-from's path (read_peft_config, load_peft_adapters) gives
PEFT's loss on the same windows (1e-4) at ep 1 in this process, and at ep 2 (dp 2) and tp 2 + SP on 2 gloo ranks in
one pool call (each rank reading its experts' and its tp shard's slices of PEFT's tensors).
Catches: one adapter for every expert (the blocks of lora_A / the interleaved columns of lora_B misread), gate and
up halves swapped, gpt-oss's interleaved gate|up rows ignored, alpha / r applied twice.
An adapter naming what tpzoo does not adapt (the router's gate.weight, one expert weight alone) is refused in one
line."""
import json
from pathlib import Path

import pytest
import torch

import tpzoo
from tpzoo.checkpoint import load_weights_into
from tpzoo.checkpoint.format import CheckpointError
from tpzoo.checkpoint.peft import load_peft_adapters, read_peft_config
from tpzoo.evaluation import evaluate
from tpzoo.models import from_hf_config
from tpzoo.models.lora import add_lora
from tpzoo.pipeline import build_model_chunks
from tpzoo.testing import run_on_ranks

peft = pytest.importorskip("peft")
SEQ = 16
TOKENS = torch.randint(0, 61, (2 * SEQ + 1,), generator=torch.Generator().manual_seed(11))
CORE = ("qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss")  # at every layout (the families)
CHEAP = ("olmoe", "qwen3_next", "qwen3_5_moe", "minimax_m2")  # in this process (slow tier)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MLPS = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight"]


def _windows():
    return [TOKENS[s:s + SEQ + 1] for s in range(0, len(TOKENS) - 1, SEQ)]  # (tpzoo.evaluation's windows)


def _peft_adapter(kind: str, path) -> tuple[str, str, float]:
    """(base dir, adapter dir, PEFT's loss): the tiny model transformers wrote, and an adapter PEFT made on it."""
    from test_lora_peft_moe import _hf_model

    hf = _hf_model(kind).float().eval()
    with torch.no_grad():  # logits of a few units (not near-uniform, nor overflowing): the loss sees every adapter
        hf.get_output_embeddings().weight.mul_(3.0 / hf(TOKENS[None, :SEQ]).logits.std())
    base, adapter = path / "base", path / "adapter"
    hf.save_pretrained(base)
    plain = _logits(hf)
    params = EXPERTS + (MLPS if kind in ("deepseek_v3", "glm4_moe") else [])
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"],
                                                    target_parameters=params))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if ".lora_B." in name else p.shape[-1] ** -0.5))
    model.save_pretrained(adapter)
    moved = (_logits(model) - plain).abs().max()
    assert moved > 0.5, (kind, moved)  # the adapters matter
    return str(base), str(adapter), _loss(model)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS[None, :SEQ]).logits


def _loss(model) -> float:
    with torch.no_grad():
        total = sum(torch.nn.functional.cross_entropy(model(w[None, :-1]).logits[0], w[1:], reduction="sum")
                    for w in _windows())
    return float(total) / (len(TOKENS) - 1)


def tpzoo_loss(base: str, adapter: str, layout: dict) -> float:
    """--lora-from's path at `layout` (called on every rank of a pool, or in this process at ep 1)."""
    dims = tpzoo.init_parallel(tp=layout.get("tp", 1), dp=layout.get("dp", 1), ep=layout.get("ep", 1))
    try:
        chunks = build_model_chunks(from_hf_config(base), dims, sequence_parallel=layout.get("sp", False))
        load_weights_into(chunks, base)
        lcfg = read_peft_config(adapter)
        assert lcfg.experts and lcfg.rank == 4
        add_lora(chunks, lcfg)
        load_peft_adapters(chunks, adapter)
        return evaluate(chunks, TOKENS, SEQ, batch_size=1)["loss"]
    finally:
        tpzoo.destroy_parallel()


def _all(jobs):
    return [tpzoo_loss(*job) for job in jobs]


class _Adapters(dict):
    """The adapter of each family, made when first asked for."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.factory = tmp_path_factory

    def __missing__(self, kind):
        self[kind] = _peft_adapter(kind, self.factory.mktemp(kind))
        return self[kind]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return _Adapters(tmp_path_factory)


@pytest.mark.parametrize("kind", list(CORE) + [pytest.param(k, marks=pytest.mark.slow) for k in CHEAP])
def test_a_peft_expert_adapter_gives_peft_loss_at_ep1(kind, adapters):
    base, adapter, want = adapters[kind]
    assert abs(tpzoo_loss(base, adapter, {}) - want) < 1e-4


def test_a_peft_expert_adapter_gives_peft_loss_at_ep2_and_tp2_sp(adapters):
    layouts = [dict(ep=2, dp=2), dict(tp=2, sp=True)]
    jobs = [(*adapters[k][:2], layout) for k in CORE for layout in layouts]
    per_rank = run_on_ranks(2, _all, jobs)
    for j, (_, _, layout) in enumerate(jobs):
        kind = CORE[j // len(layouts)]
        for rank in per_rank:
            assert abs(rank[j] - adapters[kind][2]) < 1e-4, (kind, layout, rank[j], adapters[kind][2])


def test_what_tpzoo_does_not_adapt_is_refused_in_one_line(adapters, tmp_path):
    """The router's weight as a parameter target: read as a linear target `gate`, which the model has not (add_lora,
    preflight's check); one of the experts' two parameters alone: refused by the reader."""
    from tpzoo.errors import ConfigError
    from tpzoo.models import ModelLayout, Transformer

    base, adapter, _ = adapters["qwen3_moe"]
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    for extra in ("mlp.gate.weight", "mlp.experts.down_proj"):
        bad = tmp_path / extra.replace(".", "_")
        bad.mkdir()
        params = [extra] if extra.startswith("mlp.experts") else EXPERTS + [extra]
        (bad / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": params}))
        if extra == "mlp.gate.weight":
            lcfg = read_peft_config(bad)
            with pytest.raises(ConfigError, match=r"unknown lora target gate for qwen3_moe") as exc:
                add_lora([Transformer(from_hf_config(base), ModelLayout(device="meta"))], lcfg)
        else:
            with pytest.raises(CheckpointError, match="experts' down_proj only: tpzoo adapts both") as exc:
                read_peft_config(bad)
        assert "\n" not in str(exc.value)
