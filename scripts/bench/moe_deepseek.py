"""A cut DeepSeek-V3 (multi-head latent attention with YaRN, group-limited sigmoid routing with the selection bias,
shared experts, a dense first layer) trained one step at a time by tpzoo and by transformers at the same shapes
and weights, on CPU, alternating in one process: `python scripts/bench/moe.py --family deepseek_v3`.

A step = forward + backward of the mean next-token loss (no optimizer: the same work on both sides; the
selection-bias update is a few E-sized vector operations after the step and is left out). tpzoo loads transformers'
save_pretrained, so both run the same weights on the same batches; transformers runs DeepseekV3ForCausalLM with its
default experts implementation. Single thread.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
             num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
             n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
             routed_scaling_factor=2.5, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
             v_head_dim=32, max_position_embeddings=1024,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 256, "mscale": 1.0, "mscale_all_dim": 1.0,
                              "beta_fast": 32, "beta_slow": 1},
             bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
BATCH, SEQ = 4, 256


def hf_model():
    import transformers as tf

    torch.manual_seed(0)
    model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**SHAPE))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name and p.dim() == 3:  # transformers leaves its fused expert tensors at zero
                p.normal_(std=0.02)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(std=0.1)
    return model.train()


def run(steps: int) -> str:
    from tpzoo.checkpoint import load_model
    from tpzoo.models import Inputs

    torch.set_num_threads(1)
    hf = hf_model()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        tz = load_model(d).train()
    labels_of = lambda ids: torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)  # noqa: E731

    def hf_step(ids):
        hf.zero_grad(set_to_none=True)
        loss = hf(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item()

    def tz_step(ids):
        tz.zero_grad(set_to_none=True)
        labels = labels_of(ids)
        loss = tz(Inputs(ids, labels=labels)).sum() / (labels != -100).sum()
        loss.backward()
        return loss.item()

    g = torch.Generator().manual_seed(1)
    times, first = {"transformers": [], "tpzoo": []}, {}
    for i in range(steps + 1):  # alternating; the first of each is warm-up
        ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=g)
        for name, fn in (("transformers", hf_step), ("tpzoo", tz_step)):
            t = time.perf_counter()
            loss = fn(ids)
            if i:
                times[name].append(time.perf_counter() - t)
            else:
                first[name] = loss
    params = sum(p.numel() for p in hf.parameters())
    rows = [f"| {n} | {BATCH * SEQ / statistics.median(ts):,.0f} | {statistics.median(ts):.3f} s | {first[n]:.5f} |"
            for n, ts in times.items()]
    s = SHAPE
    return f"""## DeepSeek-V3 cut: training step vs transformers (CPU)

Command: `python scripts/bench/moe.py --family deepseek_v3 --write docs/benchmarks.md` (one process, 1 thread,
torch {torch.__version__}, the two alternating, {steps} timed steps each after one warm-up; load average
{os.getloadavg()[0]:.1f} when it ran: the cores are shared, compare the two rows, not absolute numbers). Model:
DeepseekV3ForCausalLM cut to hidden {s['hidden_size']}, {s['num_hidden_layers']} layers (the first dense, FFN
{s['intermediate_size']}), MLA with q_lora_rank {s['q_lora_rank']}, kv_lora_rank {s['kv_lora_rank']}, {s['num_attention_heads']} heads of
{s['qk_nope_head_dim']} + {s['qk_rope_head_dim']} (v {s['v_head_dim']}), YaRN; {s['n_routed_experts']} routed experts (FFN
{s['moe_intermediate_size']}) in {s['n_group']} groups, top-{s['num_experts_per_tok']} of the {s['topk_group']} best groups, 1 shared expert; vocab
{s['vocab_size']}; {params / 1e6:.2f} M parameters; batch {BATCH} x {SEQ} tokens, fp32. A step = forward + backward of the mean
next-token loss (no optimizer), the same weights (tpzoo reads transformers' save_pretrained, the selection biases
included: the first losses agree).

| implementation | tokens/s (median step) | step (median) | first loss |
|---|---|---|---|
{chr(10).join(rows)}
"""
