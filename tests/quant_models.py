"""Tiny quantized Hugging Face checkpoints built here (no downloads), for tests/test_quant_*.py, and the reference
dequantization they are checked against (written out loop by loop, independent of tpzoo.quant).

    deepseek_v3   block FP8 like the hub's DeepSeek-V3: every projection (attention, dense MLP, routed and shared
                  experts) e4m3 with float32 scale_inv per 128 x 128 block, router and norms and embeddings not;
                  hidden 192 and latent ranks 96 / 96 + 64 give ragged edge blocks, and the heads, ffn and expert
                  sizes split over tp 2 along whole blocks. Written as two shards whose index puts some weights and
                  their scales in different files.
    qwen3         block FP8 with every dim a multiple of 128 (what transformers' own CPU loader dequantizes right)
    minimax_m2    block FP8 likewise: MiniMax-M2 (full-width q/k norms, partial rotary, sigmoid router with bias)
    deepseek_int4 Kimi K2 Thinking's layout: the routed experts int4 (compressed-tensors pack-quantized, group 32,
                  written by the compressed-tensors package), everything else bf16 and in the `ignore` list
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

VOCAB = 259  # the byte tokenizer's (the training tests use it)
BLOCK = 128


def hf_model(kind: str, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if kind == "qwen3":
        cfg = tf.Qwen3Config(**common, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=128)
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind == "qwen3_ragged":  # fused q|k|v and gate|up whose parts end in partial blocks (tp 1 only)
        cfg = tf.Qwen3Config(**common, hidden_size=160, intermediate_size=200, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=80)
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind == "minimax_m2":  # every dim a multiple of 128 too; partial rotary, full-width q/k norms
        cfg = tf.MiniMaxM2Config(**common, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=128, rotary_dim=64, num_local_experts=4,
                                 num_experts_per_tok=2)
        model = tf.MiniMaxM2ForCausalLM(cfg)
    else:  # deepseek_v3, deepseek_int4
        cfg = tf.DeepseekV3Config(**common, hidden_size=192, intermediate_size=256, moe_intermediate_size=256,
                                  n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                  first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.0,
                                  num_attention_heads=4, kv_lora_rank=96, q_lora_rank=96, qk_rope_head_dim=64,
                                  qk_nope_head_dim=64, v_head_dim=64, attention_bias=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        model = tf.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith(("mlp.gate.weight", "router.weight")) or "gate.weight" in name and "experts" not in name:
                p.normal_(std=1.0)  # confident routing
            elif p.dim() >= 2:  # projections, experts, embeddings, head
                p.normal_(std=0.08)
                p.mul_(torch.exp(torch.randn(p.shape[-2] // 32 + 1, 1).repeat_interleave(32, 0)[:p.shape[-2]]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.3)
    return model.eval()


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantization written block by block: scale_inv = amax / 448, q = e4m3(w / scale)."""
    r, c = w.shape
    scale = torch.zeros(math.ceil(r / BLOCK), math.ceil(c / BLOCK))
    q = torch.empty(r, c, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            scale[i, j] = blk.abs().max() / 448.0
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequant_fp8_reference(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Block by block: fp32(q) x its block's scale, partial blocks at the edges, rounded once to dtype."""
    out = torch.empty(q.shape, dtype=dtype)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = (q[rows, cols].float() * scale[i, j].float()).to(dtype)
    return out


def _quantized_fp8(name: str, t: torch.Tensor) -> bool:
    """Every linear weight of the blocks (projections, experts); not the embeddings, head, norms, routers."""
    return t.dim() == 2 and ".layers." in name and not name.endswith(("gate.weight", "norm.weight"))


def _saved(model, path: Path) -> dict:
    """save_pretrained (transformers writes its on-disk names: one tensor per expert), read back."""
    from safetensors.torch import load_file

    model.save_pretrained(path)
    out = {}
    for f in sorted(path.glob("model*.safetensors")):
        out.update(load_file(str(f)))
    return out


_WRITTEN: dict = {}  # (writer, kind, seed) -> (a directory written earlier in this process, its tensors)


def _cached(key, path: Path):
    """A copy of an identical checkpoint written earlier by this process (the tests share them), or None."""
    if key in _WRITTEN and _WRITTEN[key][0].is_dir():
        shutil.copytree(_WRITTEN[key][0], path)
        return _WRITTEN[key][1]
    return None


def write_fp8(kind: str, path, seed: int = 0) -> dict:
    """A block-FP8 checkpoint of the tiny `kind` model in `path` (two shards and an index); returns its tensors."""
    from safetensors.torch import save_file

    path = Path(path)
    if (done := _cached(("fp8", kind, seed), path)) is not None:
        return done
    state = {k: v.to(torch.bfloat16) for k, v in _saved(hf_model(kind, seed), path).items()}
    out = {}
    for name, w in state.items():
        if _quantized_fp8(name, w):
            out[name], out[name + "_scale_inv"] = fp8_blocks(w)
        else:
            out[name] = w
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    names = list(out)
    # alternate files, so that a weight and its scale (next to it in the list) land in different shards
    shards = {n: f"model-{1 + i % 2:05d}-of-00002.safetensors" for i, n in enumerate(names)}
    for f in sorted(set(shards.values())):
        save_file({n: out[n].contiguous() for n in names if shards[n] == f}, str(path / f), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in out.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": shards}))
    cfg = json.loads((path / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    _WRITTEN[("fp8", kind, seed)] = (path, out)
    return out


def write_int4(path, seed: int = 0, group: int = 32) -> dict:
    """The tiny DeepSeek-V3 with its routed experts in compressed-tensors int4 (pack-quantized, symmetric, group
    `group`), written by the compressed-tensors package; the rest bf16 and ignored. Returns the tensors."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from safetensors.torch import save_file

    path = Path(path)
    if (done := _cached(("int4", group, seed), path)) is not None:
        return done
    state = _saved(hf_model("deepseek_int4", seed), path)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out = {}
    for name, w in state.items():
        if ".experts." in name and name.endswith("proj.weight"):
            w = w.to(torch.bfloat16)
            scale = (w.float().unflatten(-1, (-1, group)).abs().amax(-1) / 7.0).to(torch.bfloat16)
            module = name[: -len(".weight")]
            packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
            for k, v in packed.items():
                out[f"{module}.{k}"] = v
        else:
            out[name] = w.to(torch.bfloat16)
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    qcfg = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                              quantization_status="compressed",
                              ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                      "re:.*mlp\\.(gate|up|down)_proj.*"])
    cfg = json.loads((path / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    cfg["quantization_config"] = {**qcfg.model_dump(exclude_none=True), "quant_method": "compressed-tensors"}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    _WRITTEN[("int4", group, seed)] = (path, out)
    return out


def dequant_int4_reference(packed: torch.Tensor, scale: torch.Tensor, shape, group: int = 32,
                           dtype=torch.float32) -> torch.Tensor:
    """compressed-tensors' own unpacking, then q x the scale of its group of `group` columns, rounded once."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    q = unpack_from_int32(packed, 4, torch.Size(shape))
    return (q.float() * scale.float().repeat_interleave(group, dim=-1)[..., :shape[-1]]).to(dtype)


# -- evaluation against transformers (tests/test_quant_parallel.py, test_minimax_m2.py) ------------------------------
SEQ, BATCH = 16, 2
STREAM = torch.randint(0, VOCAB, (3 * SEQ + 5,), generator=torch.Generator().manual_seed(3))


def hf_loss(path) -> float:
    """transformers' loss over STREAM's evaluation windows (tpzoo.evaluation's), fp32."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from tpzoo.evaluation import batches, token_windows

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    total = n = 0
    for b in batches(token_windows(STREAM, SEQ), BATCH):
        with torch.no_grad():
            logits = model(b[:, :-1]).logits
        total += F.cross_entropy(logits.flatten(0, 1).float(), b[:, 1:].flatten(), reduction="sum").item()
        n += b[:, 1:].numel()
    return total / n


def evaluate_kept(cases):
    """On every rank (run_on_ranks): for each (checkpoint, tp, ep, sequence parallel), tpzoo's evaluation loss of
    STREAM and the dtypes the model's weights are stored in (the quantized ones)."""
    import tpzoo
    from tpzoo.checkpoint import load_model
    from tpzoo.evaluation import evaluate

    out = []
    for path, tp, ep, sp in cases:
        tpzoo.init_parallel(tp=tp, ep=ep)
        try:
            model = load_model(path, sequence_parallel=sp, dtype=torch.float32).eval()
            stored = {str(p.dtype) for n, p in model.named_parameters() if n.endswith((".weight", "gate_up", "down"))
                      and p.dtype != torch.float32}
            out.append((evaluate(model, STREAM, SEQ, batch_size=BATCH)["loss"], sorted(stored)))
        finally:
            tpzoo.destroy_parallel()
    return out
