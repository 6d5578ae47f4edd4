"""Multi-token prediction (DeepSeek-V3 report, section 2.2; Megatron-Core's multi_token_prediction.py): D depths
after the main model, on the last pipeline stage beside the head, each a block of the model's own kinds.

Depth k (1..D) at position i combines the embedding of token t_{i+k} with h^{k-1}_i, the previous depth's output
(h^0: the main model's output after its final norm), and predicts t_{i+k+1} through the shared head:

    h^k_i = final_norm_k(block_k(eh_proj_k([enorm_k(Emb(t_{i+k})); hnorm_k(h^{k-1}_i)])))      (embedding first)
    loss  = LM + S * (1/D) sum_k sum_i CE(head(h^k_i), t_{i+k+1}) / N

N the trained tokens of the language model (the report's 1/T, Megatron-Core's per-token loss), so the logged
`mtp_loss` is exactly the part of the training loss S multiplies. A position counts only when its target is a
trained token (Megatron rolls the loss mask); the inputs and targets come with the batch (Inputs.mtp_ids /
mtp_labels, tpzoo.data.mtp.with_mtp_targets: computed on whole rows before context parallelism cuts them, so the
shift crosses cp ranks, and never past a packed document's end). The block k sits at layer index num_layers + k - 1
(the kinds' per-layer settings and the HF checkpoints' numbering); its auxiliary records (a router's statistics)
stay out of the model's auxiliary losses, its after-step state (a selection bias) updates like any layer's.

TP split: enorm, hnorm and final_norm replicated (partial gradients under SP, as every norm); eh_proj column-parallel
(Megatron-Core's): its output's features gathered over tp, then under SP this rank's sequence shard kept; the block
as in the main model. The embedding is the first stage's: on a last stage without it, a copy (`embed`) tied to it
over the embedding group, or the tied head itself; the head is the model's. The depths' gradient reaches the main
model only through h^0 and the shared embedding and head.

Generation (tpzoo.speculative): `draft` runs one depth over some positions with a cache of its own per depth.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from tpzoo.errors import ConfigError
from tpzoo.parallel import ColumnParallelLinear, normal_init
from tpzoo.parallel.mappings import gather_from_tp, scatter_to_sequence

from .block import TransformerBlock
from .config import ModelConfig
from .inputs import Cache, Context, Inputs, LossOptions
from .layout import ModelLayout
from .norm import Norm

IGNORE = -100


class MTPDepth(nn.Module):
    """One depth: enorm, hnorm, eh_proj, the block (layer `layer` of the config's kinds) and its final norm."""

    def __init__(self, cfg: ModelConfig, layer: int, layout: ModelLayout):
        super().__init__()
        h = cfg.hidden_size
        self.layout = layout
        self.enorm, self.hnorm = Norm(cfg, layout), Norm(cfg, layout)
        self.eh_proj = ColumnParallelLinear(2 * h, h, bias=False, init_method=normal_init(cfg.initializer_range),
                                            **layout.linear)
        self.block = TransformerBlock(cfg, layer, layout)
        self.final_norm = Norm(cfg, layout)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, ctx: Context, cache=None) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))  # [b, s, h/tp]
        group = self.layout.dims.tp_group
        x = gather_from_tp(x, group).contiguous()  # (gathered along the features: a strided view otherwise, which
        # every later tensor of the depth would inherit, and a collective on it is refused: NCCL wants contiguous)
        if self.layout.split_sequence:
            x = scatter_to_sequence(x, -2, group)
        return self.final_norm(self.block(x, ctx, cache))


class MultiTokenPrediction(nn.Module):
    """The depths (`layers`, "0" .. D-1) of a last stage; `embed`, on a stage without the embedding, its copy."""

    def __init__(self, cfg: ModelConfig, layout: ModelLayout):
        super().__init__()
        if cfg.position != "rope":
            raise ConfigError("multi-token prediction (mtp) needs rotary positions: its depths embed shifted tokens, "
                              "which learned positions would misplace")
        self.cfg = cfg
        self.layers = nn.ModuleDict({str(j): MTPDepth(cfg, cfg.num_layers + j, layout)
                                     for j in range(cfg.mtp_depths)})

    def blocks(self) -> dict[int, nn.Module]:
        """{layer index: block} of the depths."""
        return {self.cfg.num_layers + int(j): depth.block for j, depth in self.layers.items()}

    # -- training and evaluation ------------------------------------------------------------------------------------
    def forward(self, model, per_token: torch.Tensor, h: torch.Tensor, inputs: Inputs, ctx: Context,
                 loss: LossOptions) -> torch.Tensor:
        """(Called as the module, so that module hooks see the depths run.) The language model's per-token loss
        `per_token` with the depths' mean loss reported
        (model.aux_reports["mtp_loss"]: per trained token of the language model) and, training with S = loss.mtp > 0,
        its gradient S * mean attached to every token (the value returned is the language model's, unchanged)."""
        if inputs.mtp_ids is None or inputs.mtp_labels is None:
            raise ConfigError("multi-token prediction: the last stage needs each depth's inputs and targets "
                              "(Inputs.mtp_ids / mtp_labels: tpzoo.data.mtp.with_mtp_targets on the whole batch)")
        ctx = replace(ctx, records={})  # the depths' router records stay out of the model's auxiliary losses
        embed = embedding_of(model)
        hidden, depths = h, []
        for j, depth in self.layers.items():
            j = int(j)
            hidden = depth(hidden, embed(inputs.mtp_ids[..., j]), ctx)
            depths.append(model.lm_head(hidden, inputs.mtp_labels[..., j].to(hidden.device),
                                        label_smoothing=loss.label_smoothing, z_loss=loss.z_loss, fused=loss.fused))
        mean = torch.stack(depths).mean(0)
        trained = (inputs.labels != IGNORE).sum().to(mean.device)
        model.aux_reports["mtp_loss"] = mean.detach().sum() / trained.clamp(min=1)
        if loss.mtp > 0 and torch.is_grad_enabled():
            # per_token keeps its value (x - x is 0); the backward's gradient per token reaches the depths scaled by S
            per_token = per_token + loss.mtp * (mean - mean.detach())
        return per_token

    # -- drafting ---------------------------------------------------------------------------------------------------
    def new_caches(self, batch: int, max_length: int) -> list[Cache]:
        """Each depth's generation cache (its block's token mixer's), counting its own positions."""
        return [Cache({layer: block.attn.new_cache(batch, max_length)}, batch, max_length)
                for layer, block in self.blocks().items()]

    @torch.no_grad()
    def draft(self, model, depth: int, hidden: torch.Tensor, ids: torch.Tensor, cache: Cache) -> tuple:
        """Depth `depth` (0-based) over the next positions of its cache: hidden [b, s, h] (h^{depth} of those
        positions), ids [b, s] the tokens it embeds there. Returns (its output [b, s, h], the full logits of the
        last position [b, vocab]); the cache then holds s more positions."""
        ctx = model.context(ids.shape[1], cache.length)
        layer = self.cfg.num_layers + depth
        out = self.layers[str(depth)](hidden, embedding_of(model)(ids), ctx, cache[layer])
        cache.length += ids.shape[1]
        return out, model.full_logits(model.lm_head(out, position=-1)[:, 0])


def embedding_of(model):
    """The token embedding the depths use (the stage's own, or the last stage's copy), scaled as the model's."""
    embed = model.embed if model.pre_process else model.mtp.embed
    if not model.cfg.embed_scale:
        return embed

    def scaled(ids):
        e = embed(ids)
        return e * torch.tensor(model.cfg.hidden_size ** 0.5, dtype=e.dtype, device=e.device)
    return scaled


def block_layer(name: str, num_layers: int) -> int | None:
    """The layer index of a module of a chunk by its name ("layers.3.attn..." -> 3; a depth's, "mtp.layers.0...",
    -> num_layers + 0), or None outside the layers and depths (the embedding, the head)."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 1:
        return int(parts[1])
    if parts[:2] == ["mtp", "layers"] and len(parts) > 2:
        return num_layers + int(parts[2])
    return None
