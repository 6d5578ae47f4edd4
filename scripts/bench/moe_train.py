"""Training steps of tpzoo and transformers on the same Qwen3-MoE side by side (moe.py --device): tokens/s and MFU
counted on the active parameters, plus a check of tpzoo's grouped expert GEMMs against its loop on one step.

On CUDA the model is `qwen3-30b-a3b-8l` (Qwen3-30B-A3B's shapes, 8 of its 48 layers: 128 experts, top-8, expert
FFN 768, 5.6 B parameters, 1.1 B active), bf16; on CPU a toy of the same family (fp32). transformers builds its
Qwen3MoeForCausalLM from the same config (its default experts implementation, named in the output), writes it with
save_pretrained, and tpzoo loads those weights: the same model, the same batches. A step = forward + backward of the
loss with the load-balancing loss (output_router_logits) + torch AdamW (fused on CUDA) on the parameters in the
run's dtype; the two alternate step by step after a warm-up. MFU: ModelConfig.flops_per_token (active parameters'
matmuls + attention scores, forward + backward) x tokens/s over the GPU's dense bf16 peak (tpzoo.train.metrics).
"""
from __future__ import annotations

import statistics
import tempfile
import time

import torch


def bench_config(device: torch.device):
    from tpzoo.models import get_config

    cfg = get_config("qwen3-30b-a3b-8l").replace(output_router_logits=True)
    if device.type == "cuda":
        return cfg, torch.bfloat16, 2, 4096
    toy = cfg.replace(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                      ffn_hidden_size=256, moe_ffn_hidden_size=64, num_experts=16, num_experts_per_tok=4,
                      max_position_embeddings=512, bos_token_id=None, eos_token_id=None)
    return toy, torch.float32, 2, 128


def build(cfg, dtype, device, path: str, hf_experts: str | None):
    import transformers as tf
    from safetensors.torch import load_file

    from tpzoo.checkpoint.tensors import hf_to_full, load_full_tensors
    from tpzoo.models import Inputs, ModelLayout, Transformer, to_hf_config

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig.from_dict(to_hf_config(cfg)))
    finally:
        torch.set_default_dtype(default)
    if hf_experts:
        hf.set_experts_implementation(hf_experts)
    hf.save_pretrained(path)
    tz = Transformer(cfg, ModelLayout(dtype=dtype, device=device))
    load_full_tensors(tz, dict(hf_to_full(cfg, load_file(f"{path}/model.safetensors"))).__getitem__, 0, 1)
    return hf.train(), tz.train()


def steps(hf, tz, device):
    from tpzoo.models import Inputs

    fused = {"fused": True} if device.type == "cuda" else {}
    opts = {"transformers": torch.optim.AdamW(hf.parameters(), lr=1e-5, **fused),
            "tpzoo": torch.optim.AdamW(tz.parameters(), lr=1e-5, **fused)}

    def hf_loss(ids):
        return hf(input_ids=ids, labels=ids).loss  # HF shifts; + coef * aux (output_router_logits)

    def tz_loss(ids):
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
        return tz(Inputs(ids, labels=labels)).sum() / (labels != -100).sum()

    def step(name, loss_fn, ids):
        opts[name].zero_grad(set_to_none=True)
        loss = loss_fn(ids)
        loss.backward()
        opts[name].step()
        return loss.detach()
    return {"transformers": lambda ids: step("transformers", hf_loss, ids),
            "tpzoo": lambda ids: step("tpzoo", tz_loss, ids)}, tz_loss


def grouped_vs_loop(tz, loss_fn, ids) -> str:
    """One forward + backward with the experts as grouped GEMMs and as the loop: loss and expert gradients."""
    layers = [layer.mlp for layer in tz.layers.values() if layer.mlp.kind == "moe"]
    out = {}
    for gemm in ("grouped", "loop"):
        for layer in layers:
            layer.expert_gemm = gemm
        tz.zero_grad(set_to_none=True)
        loss = loss_fn(ids)
        loss.backward()
        out[gemm] = (loss.item(), [p.grad.float() for layer in layers for p in (layer.gate_up, layer.down)])
    for layer in layers:
        layer.expert_gemm = "auto"
    tz.zero_grad(set_to_none=True)
    (lg, gg), (ll, gl) = out["grouped"], out["loop"]
    rel = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(gg, gl))
    return f"loss {lg:.6f} (grouped) vs {ll:.6f} (loop), largest relative difference of an expert gradient {rel:.1e}"


def run_device(device: str, n_steps: int, hf_experts: str | None) -> str:
    from tpzoo.models.kinds.experts import use_grouped
    from tpzoo.train.metrics import device_name, peak_tflops

    device = torch.device(device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    cfg, dtype, batch, seq = bench_config(device)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        hf, tz = build(cfg, dtype, device, d, hf_experts)
    fns, tz_loss = steps(hf, tz, device)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device) for _ in range(n_steps + 1)]
    first = next(layer.mlp for layer in tz.layers.values() if layer.mlp.kind == "moe")
    rows = torch.zeros(1, cfg.hidden_size, dtype=dtype, device=device)
    gemm = "grouped" if use_grouped(first.expert_gemm, rows, first.gate_up, first.down) else "loop"
    check = grouped_vs_loop(tz, tz_loss, batches[0])
    times, losses = alternate(fns, batches, device)
    name_dev = device_name(device)
    peak = peak_tflops("bf16" if dtype == torch.bfloat16 else "fp32", name_dev)
    fpt, tokens = cfg.flops_per_token(seq), batch * seq
    rows_md = []
    for name, ts in times.items():
        tps = tokens / statistics.median(ts)
        mfu = f"{100 * tps * fpt / 1e12 / peak:.1f} %" if peak else "n/a (no known peak)"
        rows_md.append(f"| {name} | {tps:,.0f} | {statistics.median(ts):.3f} s | {mfu} | {losses[name][0]:.4f} |")
    ratio = statistics.median(times["transformers"]) / statistics.median(times["tpzoo"])
    mem = f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else "n/a"
    hf_impl = getattr(hf.config, "_experts_implementation", None)
    model = cfg.name if device.type == "cuda" else "a toy Qwen3-MoE"
    text = (f"Command: `python scripts/bench/moe.py --device {device.type} --write docs/benchmarks.md` on {name_dev}, "
            f"torch {torch.__version__}, "
            f"{time.perf_counter() - t0:.0f} s. Model: {model} (hidden {cfg.hidden_size}, {cfg.num_layers} layers, "
            f"{cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, expert FFN {cfg.expert_ffn}, vocab "
            f"{cfg.vocab_size}; {_count(cfg.num_parameters())} parameters, {_count(cfg.num_parameters(active=True))} "
            f"active), {str(dtype).split('.')[-1]}, batch {batch} x {seq} tokens. A step = forward + backward of the "
            f"loss with the load-balancing loss + AdamW, the two alternating, median of {n_steps} after a warm-up "
            f"({'wall clock' if device.type == 'cuda' else 'CPU time of the process, one thread'}). "
            f"tpzoo's experts: {gemm}; transformers' experts implementation: {hf_impl}. MFU: "
            f"{fpt / 1e9:.3g} GFLOP per token (active parameters, attention scores) over the dense "
            f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} peak. Peak memory of the run (both models and "
            f"optimizers): {mem}.")
    return (f"## Mixture of experts: training steps vs transformers ({device.type})\n\n{text}\n\n"
            "| implementation | tokens/s | step (median) | MFU (active parameters) | first loss |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows_md) + f"\n\ntpzoo / transformers speed: {ratio:.2f}x. "
            f"Grouped expert GEMMs vs the loop on one batch: {check}.\n")


def alternate(fns: dict, batches, device) -> tuple[dict, dict]:
    """Run each fn on every batch, the fns alternating: (name -> step times, the first batch's a warm-up left out;
    name -> their outputs as floats). Wall clock on CUDA; on CPU this process's CPU time (one thread: steadier on a
    shared machine)."""
    times, outs = {n: [] for n in fns}, {n: [] for n in fns}
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    for i, ids in enumerate(batches):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = clock()
            outs[name].append(float(fn(ids)))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                times[name].append(clock() - t)
    return times, outs


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
