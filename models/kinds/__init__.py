"""Layer kinds: a block is a token mixer (mixes across positions) plus a channel mixer (per position), each chosen
per layer from the config (ModelConfig.token_mixer(i) / channel_mixer(i)) through these registries.

    token mixers    "attention"  softmax attention: MHA/GQA, windows, soft-capping, q/k norms, sinks, an
                                 output gate (attention.py)
                    "mla"        multi-head latent attention (mla.py)
                    "gated_deltanet"  linear attention: Qwen3.5 / Qwen3-Next's Gated DeltaNet (gated_deltanet.py)
                    "kimi_delta" linear attention: Kimi Linear's Kimi Delta Attention (kimi_delta.py)
                    "sparse_mla" DeepSeek Sparse Attention: MLA with a lightning indexer's top-k (sparse_mla.py)
    channel mixers  "mlp"        the dense MLP (mlp.py)
                    "moe"        a mixture of experts (moe.py)

Each kind lives in its own file whose opening comment states its TP split, what crosses ranks and what its cache
holds, with its Hugging Face tensor names in `<kind>_hf.py`. The tables are models/registry.py's (a leaf); the
built-in kinds are the import list at the end of this file. Adding a kind is one registration (a test file can do
it) and, for a built-in one, one line in that list:

    @register_token_mixer("my_mixer")
    class MyMixer(nn.Module): ...

A token mixer class:
    __init__(cfg: ModelConfig, layer: int, layout: ModelLayout)
        builds its parameters on meta (layout.build / layout.linear keywords for the parallel layers), each with
        its TP split (tpzoo.parallel.mark_parallel, ShardSpec); `reset_parameters()` of its modules draws them
        (the model seeds each layer: the same full weights at any layout).
    forward(x, ctx: Context, cache=None) -> y
        x, y [b, s, h] (s: this rank's sequence shard under sequence parallelism, layout.split_sequence);
        ctx: what the forward's layers share (models/inputs.py: positions, documents, rotary tables, past length).
    new_cache(batch: int, max_length: int) -> a cache object or None (keeps nothing between steps)
        its generation state for one layer (KV, a latent, a recurrent state...): the model holds one per layer
        (models/inputs.py Cache) and passes it back to forward; the model counts the decoded tokens (ctx.past).
    rotary: RotarySpec | None       the rotary table it needs (rotary.py); the Transformer computes it once.
    core: nn.Module (optional)      its parameterless inner computation: what selective recomputation wraps.
    reads_positions: bool (optional) it reads the tokens' positions themselves (Context.positions), not only the
                                    rotary tables (Mistral 4's query temperature); the Context holds them only then.
    reads_layer(cfg, layer) -> int (optional, static) the earliest layer whose result of the same forward it reads
                                    (GLM-5's shared sparse attention: its source's selection); a pipeline stage
                                    holds both (ModelConfig.reads_layer). Default: itself.
    num_parameters(cfg, layer, active) -> int   (static: the model's count without building it)
    sequence_flops(cfg, layer, seq_len) -> int   (static: forward FLOPs per token beyond its matmuls)
A channel mixer class: the same __init__, forward(x, ctx) -> y, and num_parameters.
Either may have (all static but the last):
    check_parallel(cfg, layer, tp, cp=1, ep=1) -> None   raise ParallelLayoutError where it cannot split: the one copy
                                 of its checks, which its build, the preflight and the plan (tpzoo/plan) ask
    hf_tensor_maps(cfg, layer, ours, theirs, style=None) -> [TensorMap]   its Hugging Face names (<kind>_hf.py:
                                 `ours` e.g. "layers.3.attn", `theirs` the HF layer "model.layers.3.", `style` one of
                                 the HF layouts it knows); what families/hf_common.decoder_tensor_map asks
    run_settings(cfg, run) -> ModelConfig   cfg with a training run's options of this kind (every registered kind
                                 is asked: tpzoo/train/run_model.py), or refuses one the model cannot take
    aux_rules                    (models/aux.py) auxiliary outputs the model gathers, e.g. a router's statistics
    after_optimizer_step()       non-gradient state updated after each optimizer step
"""
from __future__ import annotations

from ..registry import (CHANNEL_MIXERS, TOKEN_MIXERS, channel_mixer_kind, layer_kinds,  # noqa: F401 (the API here)
                        register_channel_mixer, register_token_mixer, token_mixer_kind)

# The built-in kinds, each listed once (a module registers its classes when imported):
from . import attention, gated_deltanet, kimi_delta, mla, mlp, moe, sparse_mla  # noqa: E402,F401
