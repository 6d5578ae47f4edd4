"""DeepSeek-V3 (q_lora_rank set and null), GLM-4.5 and gpt-oss against transformers (tests/frontier_models.py: tiny
random models written by save_pretrained), fp32:

- conversion: `convert from-hf` at tp 2 then `convert to-hf` gives every tensor back bit for bit (the selection
  biases of every MoE layer included, gpt-oss's interleaved gate|up through tpzoo's halves and back); a config
  counting a multi-token-prediction layer whose weights the checkpoint lacks says so in one line (the MTP layers
  themselves: tests/test_mtp_convert.py); gpt-oss's MXFP4 expert weights are dequantized on import as
  transformers dequantizes them;
- evaluation: `tpzoo.evaluation.evaluate`'s loss equals transformers' within 1e-4 at tp 1 (in one process) and at
  tp 2 + SP, pp 2, ep 2 and cp 2 (ring) on 2 gloo ranks (one pool call for every family and layout);
- generation: greedy `generate` with the caches (MLA's latent cache; gpt-oss's window and sinks while decoding)
  equals transformers' `generate`, in one process and at tp 2;
- the comparisons can fail: the selection bias not loaded, gate|up not de-interleaved, the sinks ignored, YaRN's
  mscale left out of the softmax scale each move the loss beyond the tolerance.
Parameter counts of the built models equal ModelConfig.num_parameters for the named configs and cuts."""
import json
from pathlib import Path

import pytest
import torch
from frontier_models import KINDS, VOCAB, make_hf_model
from safetensors import safe_open
from safetensors.torch import save_file

import tpzoo
from tpzoo.checkpoint import convert_from_hf, convert_to_hf, load_model
from tpzoo.evaluation import evaluate
from tpzoo.generation import generate
from tpzoo.testing import run_on_ranks

SEQ, BATCH = 12, 2
TOKENS = torch.randint(0, VOCAB, (4 * SEQ + 1,), generator=torch.Generator().manual_seed(3))
PROMPT = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
NEW = 6
LAYOUTS = [dict(tp=2, sp=True), dict(pp=2), dict(ep=2), dict(cp=2)]


def _hf_loss(model) -> float:
    """Mean next-token loss over the windows tpzoo.evaluation cuts the stream into (SEQ + 1 tokens, stride SEQ)."""
    total, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(TOKENS) - 1, SEQ):
            w = TOKENS[s:s + SEQ + 1][None]
            logits = model(w[:, :-1]).logits
            total += torch.nn.functional.cross_entropy(logits[0], w[0, 1:], reduction="sum").item()
            n += w.shape[1] - 1
    return total / n


def hf_runs_of(tmp_path_factory, kinds, make, prompt, new: int) -> dict:
    """{kind: (HF directory, transformers' loss, transformers' greedy continuation of prompt)} of the models
    make(kind) builds (tests/test_dsa_families.py's too)."""
    out = {}
    for kind in kinds:
        path = tmp_path_factory.mktemp(kind)
        model = make(kind)
        model.save_pretrained(path)
        with torch.no_grad():
            greedy = model.generate(prompt, max_new_tokens=new, do_sample=False, min_new_tokens=new)
        out[kind] = (str(path), _hf_loss(model), greedy)
    return out


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    return hf_runs_of(tmp_path_factory, KINDS, make_hf_model, PROMPT, NEW)


def _ours_loss(model) -> float:
    return evaluate(model, TOKENS, SEQ, batch_size=BATCH)["loss"]


# -- conversion ---------------------------------------------------------------------------------------------------

def _tensors(path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_at_tp2_is_bit_exact(hf_runs, kind, tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    original = _tensors(Path(hf_runs[kind][0]))
    (src / "config.json").write_text((Path(hf_runs[kind][0]) / "config.json").read_text())
    save_file(original, str(src / "model.safetensors"), metadata={"format": "pt"})
    manifest = convert_from_hf(str(src), tmp_path / "tp2", tp=2, progress=False)
    convert_to_hf(str(tmp_path / "tp2"), tmp_path / "back", progress=False)
    back = _tensors(tmp_path / "back")
    assert sorted(back) == sorted(original)  # every tensor, the selection biases included
    for name, t in original.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    biases = [n for n in original if n.endswith("e_score_correction_bias")]
    assert len(biases) == (1 if kind.startswith("deepseek") or kind == "glm4_moe" else 0)  # every MoE layer
    assert all(f"{n.replace('model.', '').replace('gate.', 'router.')}" in manifest["tensors"] for n in biases)
    notes = manifest["metadata"].get("notes", [])
    if kind.startswith("deepseek") or kind == "glm4_moe":  # HF's configs say num_nextn_predict_layers = 1, over
        # checkpoints without those weights (transformers writes none): nothing built (tests/test_mtp_convert.py)
        assert len(notes) == 1 and "multi-token-prediction" in notes[0] and "holds none" in notes[0]


def _quantize_mxfp4(w):
    """An [E, in, out] weight -> (blocks, scales) whose dequantization is exactly representable values."""
    e, cols, rows = w.shape
    g = torch.Generator().manual_seed(9)
    blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 130, (e, rows, cols // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def test_mxfp4_experts_are_dequantized_on_import(hf_runs, tmp_path):
    """gpt-oss as the hub stores it (hidden and expert sizes 32: one MXFP4 block per row): the expert weights as blocks and scales,
    quantization_config mxfp4. Imported, they equal transformers' own dequantization (convert_moe_packed_tensors),
    the conversion says so in one line, and the export writes bf16 weights without a quantization_config."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = Path(hf_runs["gpt_oss"][0])
    tensors, packed = _tensors(src), {}
    for name in [n for n in tensors if n.endswith("gate_up_proj") or n.endswith("experts.down_proj")]:
        blocks, scales = _quantize_mxfp4(tensors.pop(name))
        packed[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    out = tmp_path / "mxfp4"
    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    manifest = convert_from_hf(str(out), tmp_path / "ours", progress=False)
    assert any("MXFP4" in n and "dequantized" in n for n in manifest["metadata"]["notes"])
    convert_to_hf(str(tmp_path / "ours"), tmp_path / "back", progress=False)
    back = _tensors(tmp_path / "back")
    for name, want in packed.items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], want), name
    assert not any(n.endswith("_blocks") for n in back)
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())


# -- evaluation and generation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_eval_and_greedy_generation_equal_transformers(hf_runs, kind):
    path, hf_loss, hf_greedy = hf_runs[kind]
    model = load_model(path)
    assert abs(_ours_loss(model) - hf_loss) < 1e-4
    assert torch.equal(generate(model, PROMPT, NEW), hf_greedy)


def _layouts(runs):
    """Every family at every layout of LAYOUTS on this rank: (loss, greedy continuation or None)."""
    out = []
    for layout in LAYOUTS:
        dims = tpzoo.init_parallel(tp=layout.get("tp", 1), pp=layout.get("pp", 1), cp=layout.get("cp", 1),
                                   ep=layout.get("ep", 1))
        try:
            for kind, (path, _, _) in runs.items():
                model = load_model(path, sequence_parallel=layout.get("sp", False))
                greedy = None
                if layout.get("tp") == 2:  # decoding (no SP: a one-token step is not split over tp)
                    greedy = generate(load_model(path), PROMPT, NEW)
                out.append((layout, kind, _ours_loss(model), greedy))
        finally:
            tpzoo.destroy_parallel()
    return out


def test_eval_at_every_layout_equals_transformers(hf_runs):
    runs = {kind: (path, None, None) for kind, (path, _, _) in hf_runs.items()}
    for rank in run_on_ranks(2, _layouts, runs):
        for layout, kind, loss, greedy in rank:
            assert abs(loss - hf_runs[kind][1]) < 1e-4, (layout, kind, loss, hf_runs[kind][1])
            if greedy is not None:
                assert torch.equal(greedy, hf_runs[kind][2]), (layout, kind)


def test_the_comparisons_can_fail(hf_runs, monkeypatch):
    from tpzoo.models.kinds import moe_hf  # the gpt-oss layout of the experts' HF names

    loss = {kind: hf_runs[kind][1] for kind in KINDS}
    model = load_model(hf_runs["deepseek_v3"][0])
    with torch.no_grad():  # the selection bias not loaded (left at its initial zeros)
        model.layers["1"].mlp.router.e_score_correction_bias.zero_()
    assert abs(_ours_loss(model) - loss["deepseek_v3"]) > 1e-3
    model = load_model(hf_runs["deepseek_v3"][0])
    for layer in model.layers.values():  # YaRN's mscale^2 left out of the softmax scale
        layer.attn.core.scale = (8 + 4) ** -0.5
    assert abs(_ours_loss(model) - loss["deepseek_v3"]) > 1e-3
    model = load_model(hf_runs["gpt_oss"][0])
    for layer in model.layers.values():  # the sinks ignored
        del layer.attn.sinks
    assert abs(_ours_loss(model) - loss["gpt_oss"]) > 1e-3
    monkeypatch.setattr(moe_hf, "interleaved_to_halves", lambda t, dim: t)  # gate|up read as halves
    assert abs(_ours_loss(load_model(hf_runs["gpt_oss"][0])) - loss["gpt_oss"]) > 1e-3


# -- named configs --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-glm4-moe", "tiny-gpt-oss", "moonlight-16b-a3b",
                                  "gpt-oss-20b"])
def test_parameter_counts_are_the_built_models(name):
    from tpzoo.models import ModelLayout, Transformer, get_config

    cfg = get_config(name)
    model = Transformer(cfg, ModelLayout(device="meta"))
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    # active: the routers, the top-k of each MoE layer's experts (with their biases), everything else
    expert = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-1] in
                 ("gate_up", "down", "gate_up_bias")) + sum(
        p.numel() for n, p in model.named_parameters() if n.endswith("down_bias"))
    moe = cfg.moe
    assert cfg.num_parameters() - cfg.num_parameters(active=True) == expert * (
        moe.num_experts - moe.num_experts_per_tok) // moe.num_experts
