"""The decoder-only transformer of every family, or one pipeline stage of it.

Parameter names are global and layout independent (`layers.7.attn.qkv.weight` is layer 7 on whichever stage
holds it), so checkpoints and HF mappings never depend on tp or pp:
    embed.weight, pos_embed.weight (learned positions), layers.{i}.{attn_norm,attn,mlp_norm,mlp}...,
    final_norm.{weight,bias}, lm_head.weight (absent when tied and the embedding is on the same stage).

forward() returns the hidden states on a stage without the head; on the last stage the logits shard
[b, s, V'/tp] (padded vocab, split over TP), or with `labels` the per-token loss [b, s] (0 where ignored),
computed by default without the logits of all the tokens (models/lm_head.py, fused_linear_cross_entropy).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tpzoo.errors import ConfigError
from tpzoo.parallel import (ParallelDims, VocabParallelEmbedding, gather_tp_tensor, mark_parallel, mark_tied,
                            padded_vocab_size)
from tpzoo.parallel.state import get_dims

from .blocks import Norm, TransformerBlock, rope_cos_sin, rope_inv_freq
from .config import ModelConfig
from .documents import Documents, document_positions
from .lm_head import LMHead

RECOMPUTE_MODES = ("none", "selective", "full")
ROUTER_LOSS_PP = ("a last pipeline stage computing the router loss needs the earlier stages' router statistics: "
                  "pass router_stats (the pipeline executor carries them beside the activations)")


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device):
    """Draw one module's initial weights from its own seed: the same weights whatever else this rank builds.
    The generator is the device's (CPU: the CPU one), and every other RNG state is left as it was."""
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _reset(module: nn.Module) -> None:
    """reset_parameters() of every submodule that has one, in registration order."""
    for m in module.modules():
        if m is not module and hasattr(m, "reset_parameters") and not isinstance(m, nn.Embedding):
            m.reset_parameters()


class Transformer(nn.Module):
    """One pipeline chunk (or the whole model) of a zoo family on this rank of `dims`.

    Built the torchtitan way: every module is created on the meta device (no memory, no random draws), then
    `materialize(device)` allocates it and `init_weights()` fills it (a checkpoint loader fills it instead). With
    `device="meta"` the model stays unallocated; otherwise (default: dims.device) both steps run here.
    """

    def __init__(self, cfg: ModelConfig, *, dims: ParallelDims | None = None, layers: tuple[int, int] | None = None,
                 pre_process: bool = True, post_process: bool = True, sequence_parallel: bool = False,
                 recompute: str = "none", seed: int = 0, vocab_padding_multiple: int = 1, dtype=None, device=None,
                 cp_mode: str = "ring", fused_linear_cross_entropy: bool = True):
        super().__init__()
        if recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        self.dims = dims = get_dims(dims)
        self.cfg, self.sequence_parallel, self.recompute = cfg, sequence_parallel, recompute
        self.pre_process, self.post_process, self.seed = pre_process, post_process, seed
        start, end = layers if layers is not None else (0, cfg.num_layers)
        self.layer_range = (start, end)
        kw = {"dtype": dtype, "device": "meta"}
        # A function of the config, not a bound method: held by the children, a method would tie the model into a
        # reference cycle (freed only by Python's cyclic GC, so a dropped model's GPU memory would linger).
        self._init_method = init = functools.partial(nn.init.normal_, std=cfg.initializer_range)
        if pre_process:
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, vocab_padding_multiple,
                                                sequence_parallel, init, dims=dims, **kw)
            if cfg.position == "learned":
                # _weight given: nn.Embedding draws nothing at construction (init_weights does).
                self.pos_embed = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                              _weight=torch.empty(cfg.max_position_embeddings, cfg.hidden_size,
                                                                  **kw))
                # Under SP each rank adds positions to its own sequence chunk: a partial gradient.
                mark_parallel(self.pos_embed.weight, None, sequence_parallel)
        self.layers = nn.ModuleDict()
        for i in range(start, end):
            self.layers[str(i)] = TransformerBlock(cfg, sequence_parallel, dims, layer=i, **kw)
            self.layers[str(i)].attn.recompute_core = recompute == "selective"
        self.set_cp_mode(cp_mode)
        if post_process:
            self.final_norm = Norm(cfg, sequence_parallel, **kw)
            vocab_padded = padded_vocab_size(cfg.vocab_size, dims.tp, vocab_padding_multiple)
            # Tied: the head is drawn exactly like the embedding, so a separate last-stage copy starts equal.
            head_init = _embedding_init(init, cfg.vocab_size) if cfg.tie_embeddings else init
            self.lm_head = LMHead(cfg.hidden_size, vocab_padded, cfg.vocab_size, softcap=cfg.final_softcap,
                                  fused=fused_linear_cross_entropy, sequence_parallel=sequence_parallel,
                                  init_method=head_init, dims=dims, **kw)
            if cfg.tie_embeddings and pre_process:
                self.lm_head.weight = self.embed.weight
        if cfg.tie_embeddings:  # declared here, so no one has to find tied weights by name
            if pre_process:
                mark_tied(self.embed.weight, "embedding", primary=True)
            elif post_process:
                mark_tied(self.lm_head.weight, "embedding", primary=False)
        self.moe_layers = [i for i in range(start, end) if cfg.is_moe_layer(i)]
        # The router loss couples every MoE layer of the whole model (not only this chunk's): with pipeline
        # parallelism each stage adds its layers' sums to statistics that travel with the activations.
        self.num_moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        self.router_loss_on = bool(self.num_moe_layers) and bool(cfg.output_router_logits) and bool(
            cfg.router_aux_loss_coef or cfg.router_z_loss_coef)
        self.aux_loss = self.z_loss = None  # of the last forward (detached; HF's aux_loss output)
        if cfg.position == "rope":
            self.register_buffer("inv_freq", torch.empty(cfg.rotary_dim // 2, device="meta"), persistent=False)
        if cfg.rope_local_theta is not None:  # Gemma 3: sliding layers rotate with their own base
            self.register_buffer("inv_freq_local", torch.empty(cfg.rotary_dim // 2, device="meta"), persistent=False)
        device = torch.device(device) if device is not None else dims.device
        if device.type != "meta":
            self.materialize(device)
            self.init_weights()

    # -- materialization ------------------------------------------------------------------------------------
    def materialize(self, device) -> "Transformer":
        """Meta -> uninitialized storage on `device` (weights still to be filled: init_weights() or a checkpoint),
        and the derived buffers (rotary frequencies) computed there."""
        device = torch.device(device)
        # to_empty replaces meta parameters by new objects: that unties shared ones (a tied head) and drops the
        # attributes the parallel layers set on them (tp_spec, tied_group...). Restore both.
        owners: dict[int, tuple[list, dict]] = {}
        for mod in self.modules():
            for name, p in mod._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), ([], dict(p.__dict__)))[0].append((mod, name))
        self.to_empty(device=device)
        for places, attrs in owners.values():
            first_mod, first_name = places[0]
            param = first_mod._parameters[first_name]
            param.__dict__.update(attrs)
            for mod, name in places[1:]:
                mod._parameters[name] = param
        if self.cfg.position == "rope":
            self.inv_freq = rope_inv_freq(self.cfg).to(device)
        if self.cfg.rope_local_theta is not None:
            local = self.cfg.replace(rope_theta=self.cfg.rope_local_theta, rope_scaling=None)
            self.inv_freq_local = rope_inv_freq(local).to(device)
        return self

    @torch.no_grad()
    def init_weights(self) -> "Transformer":
        """The layout-independent initialization: each module draws its full weights from its own seed (the
        embedding from `seed`, layer i from seed + 1 + i, an untied head from seed + 1 + num_layers) and keeps its
        shard, so one seed gives the same full model at every (tp, pp, virtual stages)."""
        cfg, seed, device = self.cfg, self.seed, self.device
        if self.pre_process:
            with _seeded(seed, device):
                self.embed.reset_parameters()
                if cfg.position == "learned":
                    self._init_method(self.pos_embed.weight)
        for i, layer in self.layers.items():
            with _seeded(seed + 1 + int(i), device):
                _reset(layer)
        if self.post_process:
            self.final_norm.reset_parameters()
            if not (cfg.tie_embeddings and self.pre_process):  # else the head is the embedding itself
                with _seeded(seed if cfg.tie_embeddings else seed + 1 + cfg.num_layers, device):
                    self.lm_head.reset_parameters()
        return self

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def set_cp_mode(self, mode: str) -> "Transformer":
        """How attention spans the context-parallel ranks when dims.cp > 1: "ring" or "a2a" (all-to-all)."""
        if mode not in ("ring", "a2a"):
            raise ConfigError(f"cp_mode must be 'ring' or 'a2a', got {mode!r}")
        for layer in self.layers.values():
            layer.attn.cp_mode = mode
        return self

    # -- helpers --------------------------------------------------------------------------------------------
    @property
    def vocab_padded(self) -> int:
        return (self.lm_head.out_features if self.post_process else self.embed.num_embeddings_padded)

    def _positions(self, input_like: torch.Tensor, seq_len: int, past: int, position_ids):
        if position_ids is not None:
            return position_ids
        if self.dims.cp > 1:  # the tokens of this rank are not 0..s-1 (tpzoo.parallel.context_parallel)
            raise ConfigError("context parallelism: pass the position_ids of this rank's tokens "
                              "(tpzoo.parallel.context_parallel.shard_batch gives them)")
        return torch.arange(past, past + seq_len, device=input_like.device).unsqueeze(0)

    def _documents(self, doc_ids, seq_len: int, kv_caches) -> Documents | None:
        if doc_ids is None:
            return None
        if kv_caches:
            raise ConfigError("doc_ids (document masking of packed batches) do not decode with a KV cache: "
                              "generation runs one document per row")
        if doc_ids.shape[1] != seq_len * self.dims.cp:  # cp: the whole (padded) sequence, not this rank's chunks
            raise ConfigError(f"doc_ids cover {doc_ids.shape[1]} tokens per row, but the sequence has "
                              f"{seq_len * self.dims.cp} (at cp > 1 pass the whole padded sequence's: shard_batch)")
        return Documents(doc_ids)

    def _seq_chunk(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the sequence dim (-2) under sequence parallelism."""
        if not self.sequence_parallel or self.dims.tp == 1:
            return t
        return t.chunk(self.dims.tp, dim=-2)[self.dims.tp_rank]

    # -- forward --------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                kv_caches: list | None = None, label_smoothing: float = 0.0,
                router_stats: torch.Tensor | None = None, token_mask: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, router_loss: bool = True, z_loss: float = 0.0,
                logits_position: int | None = None):
        """input_ids [b, s] on the first stage, else `hidden` from the previous stage (seq-sharded under SP).
        label_smoothing, z_loss: of the loss (with labels; tpzoo.parallel.vocab_parallel_cross_entropy).
        logits_position (without labels): only that position's logits, [b, 1, V'/tp] (generation).

        router_stats (pipeline training with the router loss): the router statistics of the earlier stages
        (models.moe.stage_stats; zeros on the first stage). This chunk adds its layers' sums; a chunk without the
        head then returns (hidden, statistics) for the next stage, the last one computes the router loss from the
        totals. Without it, a chunk that is the whole model computes the loss from its own layers.
        token_mask [b, s] (this rank's tokens, before SP's split): the tokens the router statistics count (0: an
        SFT sample's padding, as transformers' attention mask; context parallelism's padding, which HF's sequence
        does not have); None: all.
        doc_ids [b, S] (a packed batch; models/documents.py): each token's document in its row's whole sequence
        (every cp rank passes all of it, padded as tpzoo.parallel.context_parallel.shard_batch does); attention
        then stays within documents, and without position_ids (cp=1) positions restart at each document.
        router_loss=False: the per-token loss is the language model's alone, even for a model that trains with the
        router losses (evaluation: they are still computed into aux_loss / z_loss from the statistics at hand)."""
        tp = self.dims.tp
        seq_len = input_ids.shape[1] if input_ids is not None else hidden.shape[1] * (
            tp if self.sequence_parallel else 1)
        ref = input_ids if input_ids is not None else hidden
        past = kv_caches[0].length if kv_caches else 0
        if self.sequence_parallel and seq_len % tp:
            raise ConfigError(f"sequence parallelism: sequence length {seq_len} is not divisible by "
                             f"tp={tp}; pad the sequence or turn sequence parallelism off")
        docs = self._documents(doc_ids, seq_len, kv_caches)
        if docs is not None and position_ids is None and self.dims.cp == 1:
            position_ids = document_positions(doc_ids)
        positions = self._positions(ref, seq_len, past, position_ids)
        if self.pre_process:
            h = self.embed(input_ids)
            if self.cfg.embed_scale:  # Gemma: sqrt(hidden), rounded to the activations' dtype as HF does
                h = h * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=h.dtype, device=h.device)
            if self.cfg.position == "learned":
                h = h + self.pos_embed(self._seq_chunk(positions.expand(input_ids.shape[0], -1).unsqueeze(-1))
                                       .squeeze(-1))
        else:
            h = hidden
        if self.moe_layers:
            mask = None if token_mask is None else self._seq_chunk(token_mask.unsqueeze(-1)).reshape(-1)
            for i in self.moe_layers:
                self.layers[str(i)].mlp.token_mask = mask
        rotary = {None: (None, None)}  # each layer's table: "global", "local" (Gemma 3) or None (no rope)
        if self.cfg.position == "rope":
            rotary["global"] = rope_cos_sin(self.inv_freq, positions)
        if self.cfg.rope_local_theta is not None:
            rotary["local"] = rope_cos_sin(self.inv_freq_local, positions)
        for j, layer in enumerate(self.layers.values()):
            cache = kv_caches[j] if kv_caches else None
            cos, sin = rotary[layer.rope]
            if self.recompute == "full" and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, cache, docs, use_reentrant=False)
            else:
                h = layer(h, cos, sin, cache, docs)
        if router_stats is not None:
            from .moe import stage_stats

            stats = [self.layers[str(i)].mlp.last_stats for i in self.moe_layers]
            E = self.cfg.num_experts
            # the incoming counts carry no gradient (assignments): only the probability and z sums send one back
            incoming = torch.cat([router_stats[:E].detach(), router_stats[E:]])
            router_stats = incoming + stage_stats(stats, E, h.device)
            if not self.post_process:
                return h, router_stats
            aux = self._router_losses(router_stats)
        else:
            if self.router_loss_on and router_loss and labels is not None and not (
                    self.pre_process and self.post_process):
                # HF's load-balancing loss couples every layer's routing (one product of global sums), so a
                # pipeline stage cannot add its share alone.
                raise ConfigError(ROUTER_LOSS_PP)
            if self.moe_layers and self.pre_process and self.post_process:
                from .moe import stage_stats

                stats = [self.layers[str(i)].mlp.last_stats for i in self.moe_layers]
                aux = self._router_losses(stage_stats(stats, self.cfg.num_experts, h.device))
        if not self.post_process:
            return h
        h = self.final_norm(h)
        if labels is None:
            return self.lm_head(h, position=logits_position)
        per_token = self.lm_head(h, labels, label_smoothing=label_smoothing, z_loss=z_loss)
        if self.router_loss_on and router_loss:
            # HF: loss = mean CE + coef * aux. Added to every trained token, the mean over tokens (the loss tpzoo
            # backpropagates and reports) gets exactly that; over micro-batches, a token-weighted mean of each's.
            per_token = per_token + aux * (labels.to(per_token.device) != -100)
        return per_token

    def router_logits(self) -> list[torch.Tensor]:
        """Each MoE layer's router logits of the last forward ([tokens, E]; this rank's sequence shard under SP)."""
        return [self.layers[str(i)].mlp.last_stats["logits"] for i in self.moe_layers]

    def _router_losses(self, totals: torch.Tensor) -> torch.Tensor:
        """HF's load-balancing loss and the z-loss of the last forward (stored detached), and their weighted sum,
        from the statistics of every MoE layer of the model on this rank's tokens (`totals`)."""
        from .moe import router_losses

        aux, z = router_losses(totals, self.num_moe_layers, self.cfg.num_experts, self.dims.tp_group,
                               self.sequence_parallel, self.dims.cp_group if self.dims.cp > 1 else None)
        self.aux_loss, self.z_loss = aux.detach(), z.detach()
        return self.cfg.router_aux_loss_coef * aux + self.cfg.router_z_loss_coef * z

    @torch.no_grad()
    def full_logits(self, logits_shard: torch.Tensor) -> torch.Tensor:
        """Gather the vocab shards and drop the padding: [b, s, vocab] (for sampling and comparisons)."""
        return gather_tp_tensor(logits_shard, -1, dims=self.dims)[..., : self.cfg.vocab_size]


def _embedding_init(init, vocab_size: int):
    def fill(master: torch.Tensor) -> None:
        init(master[:vocab_size])
        master[vocab_size:].zero_()
    return fill


class KVCache:
    """Keys and values of the tokens seen so far, for one layer on this rank ([b, kv_heads/tp, s, hd])."""

    def __init__(self):
        self.k = self.v = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor):
        past = self.length
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v, past


def new_kv_caches(model: Transformer) -> list[KVCache]:
    return [KVCache() for _ in model.layers]
