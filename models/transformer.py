"""The decoder-only transformer of every family: one pipeline chunk (or the whole model) on this rank.

    model = Transformer(cfg, ModelLayout(dims, sequence_parallel=True), Stage(layers=range(0, 8), post_process=False))
    out = model(Inputs(ids, labels=labels), cache=None, loss=LossOptions(label_smoothing=0.1))

Parameter names are global and layout independent (`layers.7.attn.qkv.weight` is layer 7 on whichever stage
holds it), so checkpoints and HF mappings never depend on tp or pp:
    embed.weight, pos_embed.weight (learned positions), layers.{i}.{attn_norm,attn,mlp_norm,mlp}...,
    final_norm.{weight,bias}, lm_head.weight (absent when tied and the embedding is on the same stage),
    mtp.layers.{j}.{enorm,hnorm,eh_proj,block.*,final_norm} (multi-token prediction, models/mtp.py) and, on a last
    stage without the embedding, mtp.embed.weight (its copy; the tied head when tied).

forward() returns on a chunk without the head the hidden states (with the auxiliary sums beside them when the
pipeline carries them: (hidden, {key: vector})); on the last stage the logits shard [b, s, V'/tp] (padded vocab,
split over TP), or with labels the per-token loss [b, s] (0 where ignored), computed by default without the
logits of all the tokens (models/lm_head.py, fused_linear_cross_entropy).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn

from tpzoo.errors import ConfigError
from tpzoo.parallel import VocabParallelEmbedding, gather_tp_tensor, mark_parallel, mark_tied, padded_vocab_size

from .aux import after_optimizer_step, carried_sizes, model_rules
from .block import TransformerBlock
from .config import ModelConfig
from .documents import Documents, document_positions
from .inputs import Cache, Context, Inputs, LossOptions
from .kinds.rotary import attention_factor, cos_sin, inv_freq
from .layout import ModelLayout, Stage
from .lm_head import LMHead
from .mtp import MultiTokenPrediction
from .norm import Norm

CARRY_AUX = ("a last pipeline stage computing the {} losses needs the earlier stages' auxiliary sums: pass "
             "Inputs.aux (the pipeline executor carries them beside the activations)")


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
    """One pipeline chunk (or the whole model) of a zoo model on this rank: `stage` says which layers and whether
    it embeds (pre_process) and holds the head (post_process); `layout` how it is split (ModelLayout, or a
    ParallelDims; default: the default dims); `seed` its initial weights (the same full weights at any layout).

    Built the torchtitan way: every module is created on the meta device (no memory, no random draws), then
    `materialize(device)` allocates it and `init_weights()` fills it (a checkpoint loader fills it instead). With
    layout.device "meta" the model stays unallocated; otherwise (default: dims.device) both steps run here.
    Recomputation is applied afterwards (models/recompute.py apply_recompute).
    """

    def __init__(self, cfg: ModelConfig, layout: ModelLayout | None = None, stage: Stage | None = None,
                 seed: int = 0):
        super().__init__()
        self.layout = layout = ModelLayout.of(layout)
        self.stage = stage = (stage or Stage()).resolved(cfg.num_layers)
        self.cfg, self.dims, self.seed = cfg, layout.dims, seed
        self.pre_process, self.post_process = stage.pre_process, stage.post_process
        self.recompute = "none"
        kw = {"dtype": layout.dtype, "device": "meta"}
        # A function of the config, not a bound method: held by the children, a method would tie the model into a
        # reference cycle (freed only by Python's cyclic GC, so a dropped model's GPU memory would linger).
        self._init_method = init = functools.partial(nn.init.normal_, std=cfg.initializer_range)
        if self.pre_process:
            self.embed = _embedding(cfg, layout, init)
            if cfg.position == "learned":
                # _weight given: nn.Embedding draws nothing at construction (init_weights does).
                self.pos_embed = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                              _weight=torch.empty(cfg.max_position_embeddings, cfg.hidden_size,
                                                                  **kw))
                # Under SP each rank adds positions to its own sequence chunk: a partial gradient.
                mark_parallel(self.pos_embed.weight, None, layout.sequence_parallel)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i, layout) for i in stage.layers})
        if self.post_process:
            self.final_norm = Norm(cfg, layout)
            vocab_padded = padded_vocab_size(cfg.vocab_size, layout.tp, layout.padding_multiple)
            # Tied: the head is drawn exactly like the embedding, so a separate last-stage copy starts equal.
            head_init = _embedding_init(init, cfg.vocab_size) if cfg.tie_embeddings else init
            self.lm_head = LMHead(cfg.hidden_size, vocab_padded, cfg.vocab_size, softcap=cfg.final_softcap,
                                  sequence_parallel=layout.sequence_parallel, init_method=head_init,
                                  dims=layout.dims, **kw)
            if cfg.tie_embeddings and self.pre_process:
                self.lm_head.weight = self.embed.weight
        # Multi-token prediction's depths (models/mtp.py) beside the head; on a last stage without the embedding,
        # their copy of it (the tied head itself when the head is tied)
        self.mtp = MultiTokenPrediction(cfg, layout) if self.post_process and cfg.mtp is not None else None
        if self.mtp is not None and not self.pre_process:
            self.mtp.embed = _embedding(cfg, layout, init)
            if cfg.tie_embeddings:
                self.mtp.embed.weight = self.lm_head.weight
            else:
                mark_tied(self.mtp.embed.weight, "embedding", primary=False)
        if cfg.tie_embeddings or cfg.mtp is not None:  # declared here, so no one has to find tied weights by name
            if self.pre_process:
                mark_tied(self.embed.weight, "embedding", primary=True)
            elif self.post_process and cfg.tie_embeddings:
                mark_tied(self.lm_head.weight, "embedding", primary=False)
        # The rotary tables this chunk's layers use (models/kinds/rotary.py), one buffer each, computed once per
        # forward; and the auxiliary-output rules of the whole model's kinds (models/aux.py).
        # a mixer that reads the tokens' positions themselves (Context.positions), not only their rotary tables
        self.reads_positions = any(getattr(block.attn, "reads_positions", False) for block in self.blocks().values())
        specs = [getattr(block.attn, "rotary", None) for block in self.blocks().values()]
        self.rotary_specs = list(dict.fromkeys(s for s in specs if s is not None))
        for j, spec in enumerate(self.rotary_specs):
            self.register_buffer(f"inv_freq_{j}", torch.empty(spec.dim // 2, device="meta"), persistent=False)
        self.aux_rules = model_rules(cfg)
        self.aux_reports: dict = {}  # of the last forward that reduced them (detached; HF's aux_loss...)
        if cfg.quantization:  # a kept-quantized checkpoint's model: those weights stay quantized (tpzoo.quant)
            from tpzoo.quant.modules import apply_quantization

            apply_quantization(self, cfg.quantization, layout.dtype)
        device = layout.device if layout.device is not None else layout.dims.device
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
        for j, spec in enumerate(self.rotary_specs):
            setattr(self, f"inv_freq_{j}", inv_freq(spec).to(device))
        return self

    @torch.no_grad()
    def init_weights(self) -> "Transformer":
        """The layout-independent initialization: each module draws its full weights from its own seed (the
        embedding from `seed`, layer i from seed + 1 + i, an untied head from seed + 1 + num_layers) and keeps its
        shard, so one seed gives the same full model at every (tp, pp, virtual stages)."""
        cfg, seed, device = self.cfg, self.seed, self.device
        if cfg.quantization:
            raise ConfigError(f"{cfg.name or cfg.family}: a kept-quantized model has no initialization; its weights "
                              f"come from its checkpoint")
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
        if self.mtp is not None:  # depth j from seed + 2 + num_layers + j; a copy of the embedding drawn as it
            for j, depth in self.mtp.layers.items():
                with _seeded(seed + 2 + cfg.num_layers + int(j), device):
                    _reset(depth)
            if not self.pre_process and not cfg.tie_embeddings:
                with _seeded(seed, device):
                    self.mtp.embed.reset_parameters()
        return self

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sequence_parallel

    @property
    def vocab_padded(self) -> int:
        return (self.lm_head.out_features if self.post_process else self.embed.num_embeddings_padded)

    def blocks(self) -> dict[int, nn.Module]:
        """{layer index: block} of this chunk: its layers, then the multi-token-prediction depths' blocks (layer
        indices num_layers and on)."""
        blocks = {int(i): layer for i, layer in self.layers.items()}
        return (blocks | self.mtp.blocks()) if self.mtp is not None else blocks

    # -- generation state and step hooks --------------------------------------------------------------------
    def new_cache(self, batch: int, max_length: int) -> Cache:
        """Each layer's generation cache, made by its token mixer, for `batch` rows of up to `max_length` tokens."""
        return Cache({int(i): layer.attn.new_cache(batch, max_length) for i, layer in self.layers.items()},
                     batch, max_length)

    def carried_aux(self, loss: LossOptions) -> dict[str, int]:
        """{key: size} of the auxiliary sums a labelled forward with `loss` passes between pipeline stages (empty:
        none; the same on every chunk of the model)."""
        return carried_sizes(self.cfg, loss)

    def after_optimizer_step(self) -> None:
        """After each optimizer step: every module with non-gradient state to update from the step (models/aux.py)
        does it. A model in several chunks calls models.aux.after_optimizer_step(chunks) once instead."""
        after_optimizer_step([self])

    # -- forward --------------------------------------------------------------------------------------------
    def forward(self, inputs, cache: Cache | None = None, loss: LossOptions | None = None):
        """inputs: an Inputs (or a tensor of token ids); cache: from new_cache() (generation); loss: the
        LossOptions of the last stage. See models/inputs.py."""
        inputs, loss = Inputs.of(inputs), loss or LossOptions()
        ctx, h = self._enter(inputs, cache)
        for i, layer in self.layers.items():
            h = layer(h, ctx, cache[int(i)] if cache is not None else None)
        if cache is not None:
            cache.length += ctx.length
        carried, reduced = self._auxiliary(ctx, inputs, loss, h.device)
        if not self.post_process:
            return h if carried is None else (h, carried)
        h = self.final_norm(h)
        if inputs.labels is None:
            logits = self.lm_head(h, position=loss.logits_position)
            return (logits, h) if loss.hidden else logits
        labels = inputs.labels
        per_token = self.lm_head(h, labels, label_smoothing=loss.label_smoothing, z_loss=loss.z_loss,
                                 fused=loss.fused)
        if self.mtp is not None and loss.mtp is not None:
            per_token = self.mtp(self, per_token, h, inputs, ctx, loss)
        if loss.aux_losses:
            for term in reduced:
                # HF: loss = mean CE + coef * aux. Added to every trained token, the mean over tokens (the loss
                # tpzoo backpropagates and reports) gets exactly that; over micro-batches, a token-weighted mean.
                per_token = per_token + term * (labels.to(per_token.device) != -100)
        return per_token

    def _enter(self, inputs: Inputs, cache: Cache | None) -> tuple[Context, torch.Tensor]:
        """The forward's Context and the activation entering the first layer (the embedding, or `hidden`)."""
        tp, sp = self.dims.tp, self.layout.sequence_parallel
        ids, hidden = inputs.ids, inputs.hidden
        if self.pre_process and ids is None:
            raise ConfigError("the first pipeline stage embeds token ids: pass Inputs(ids=...)")
        if not self.pre_process and hidden is None:
            raise ConfigError("a pipeline stage after the first takes the previous one's activation: "
                              "pass Inputs(hidden=...)")
        ref = ids if self.pre_process else hidden
        seq_len = ids.shape[1] if self.pre_process else hidden.shape[1] * (tp if sp else 1)
        if sp and seq_len % tp:
            raise ConfigError(f"sequence parallelism: sequence length {seq_len} is not divisible by "
                              f"tp={tp}; pad the sequence or turn sequence parallelism off")
        past = cache.length if cache is not None else 0
        ctx = Context(seq_len, self._documents(inputs.doc_ids, seq_len, cache), past=past)
        if inputs.token_mask is not None:
            ctx.token_mask = self._seq_chunk(inputs.token_mask.unsqueeze(-1)).reshape(-1)
        positions = self._positions(inputs, ref, seq_len, past)
        self._rotary(ctx, positions)
        if not self.pre_process:
            return ctx, hidden
        h = self.embed(ids)
        if self.cfg.embed_scale:  # Gemma: sqrt(hidden), rounded to the activations' dtype as HF does
            h = h * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=h.dtype, device=h.device)
        if self.cfg.position == "learned":
            positions = positions.expand(ids.shape[0], -1).unsqueeze(-1)
            h = h + self.pos_embed(self._seq_chunk(positions).squeeze(-1))
        return ctx, h

    def _rotary(self, ctx: Context, positions: torch.Tensor) -> None:
        if self.reads_positions:  # (only then: a Context a recomputed block keeps holds nothing it does not use)
            ctx.positions = positions
        for j, spec in enumerate(self.rotary_specs):
            ctx.rotary[spec] = cos_sin(getattr(self, f"inv_freq_{j}"), positions, attention_factor(spec))

    def context(self, seq_len: int, past: int) -> Context:
        """The Context of `seq_len` tokens after `past` cached ones (positions past .. past + seq_len - 1): what a
        cached forward outside the main layers (a multi-token-prediction draft, models/mtp.py) gives its block."""
        ctx = Context(seq_len, past=past)
        self._rotary(ctx, torch.arange(past, past + seq_len, device=self.device).unsqueeze(0))
        return ctx

    def _positions(self, inputs: Inputs, ref: torch.Tensor, seq_len: int, past: int) -> torch.Tensor:
        if inputs.positions is not None:
            return inputs.positions
        if self.dims.cp > 1:  # the tokens of this rank are not 0..s-1 (tpzoo.parallel.context_parallel)
            raise ConfigError("context parallelism: pass the positions of this rank's tokens "
                              "(tpzoo.parallel.context_parallel.shard_batch gives them)")
        if inputs.doc_ids is not None:  # a packed batch: positions restart at every document
            return document_positions(inputs.doc_ids)
        return torch.arange(past, past + seq_len, device=ref.device).unsqueeze(0)

    def _documents(self, doc_ids, seq_len: int, cache) -> Documents | None:
        if doc_ids is None:
            return None
        if cache is not None:
            raise ConfigError("doc_ids (document masking of packed batches) do not decode with a KV cache (nor any "
                              "layer's generation cache): generation runs one document per row")
        if doc_ids.shape[1] != seq_len * self.dims.cp:  # cp: the whole (padded) sequence, not this rank's chunks
            raise ConfigError(f"doc_ids cover {doc_ids.shape[1]} tokens per row, but the sequence has "
                              f"{seq_len * self.dims.cp} (at cp > 1 pass the whole padded sequence's: shard_batch)")
        return Documents(doc_ids)

    def _seq_chunk(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the sequence dim (-2) under sequence parallelism."""
        if not self.layout.split_sequence:
            return t
        return t.chunk(self.dims.tp, dim=-2)[self.dims.tp_rank]

    def _auxiliary(self, ctx: Context, inputs: Inputs, loss: LossOptions, device) -> tuple:
        """(the auxiliary sums to pass to the next stage, or None; the loss terms of the totals reduced here).

        Each rule's sum over this chunk's layers (models/aux.py) is added to the earlier stages' (inputs.aux, when
        the pipeline carries them); a chunk without the head passes the totals on, the last one reduces them into
        Transformer.aux_reports and the terms its loss adds. A chunk that is the whole model reduces its own."""
        cfg, rules = self.cfg, self.aux_rules
        whole = self.pre_process and self.post_process
        if inputs.aux is not None:
            totals = {}
            for key, rule in rules.items():
                if rule.carried(cfg, loss):
                    own = rule.combine(cfg, ctx.recorded(key), device)
                    totals[key] = inputs.aux[key] + own if key in inputs.aux else own
            if not self.post_process:
                return totals, []
        elif whole:
            recorded = {key: ctx.recorded(key) for key in rules}
            totals = {key: rules[key].combine(cfg, records, device) for key, records in recorded.items() if records}
        else:
            training = [k for k, rule in rules.items() if rule.trains(cfg)]
            if training and loss.aux_losses and inputs.labels is not None:
                # e.g. HF's load-balancing loss couples every layer's routing (one product of global sums), so a
                # pipeline stage cannot add its share alone.
                raise ConfigError(CARRY_AUX.format(", ".join(training)))
            return None, []
        terms = []
        for key, total in totals.items():
            term, reports = rules[key].reduce(cfg, self.layout, total)
            self.aux_reports.update(reports)
            if term is not None:
                terms.append(term)
        return None, terms

    @torch.no_grad()
    def full_logits(self, logits_shard: torch.Tensor) -> torch.Tensor:
        """Gather the vocab shards and drop the padding: [b, s, vocab] (for sampling and comparisons)."""
        return gather_tp_tensor(logits_shard, -1, dims=self.dims)[..., : self.cfg.vocab_size]


def _embedding(cfg: ModelConfig, layout: ModelLayout, init) -> VocabParallelEmbedding:
    return VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, layout.padding_multiple, layout.sequence_parallel,
                                  init, dims=layout.dims, dtype=layout.dtype, device="meta")


def _embedding_init(init, vocab_size: int):
    def fill(master: torch.Tensor) -> None:
        init(master[:vocab_size])
        master[vocab_size:].zero_()
    return fill
