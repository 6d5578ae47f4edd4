"""Test-only layer kinds over the building blocks of issues 32 and 33 (models/mla.py LatentAttention,
models/gated_deltanet.py GatedDeltaNet), so the plan's costs for the "mla" and "gated_deltanet" kinds
(tpzoo/plan/kinds/mla.py, gated_deltanet.py) are proved against whole tpzoo models before those kinds land. They
are registered under test names ("test_mla", "test_gdn") with the plan's costs attached to those names, and read
their settings from a ModelConfig with the `mla` / `gated_deltanet` sub-configs the families will add (KindsConfig).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from tpzoo.models.config import ModelConfig, MoEConfig
from tpzoo.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from tpzoo.models.kinds import CHANNEL_MIXERS, TOKEN_MIXERS, register_channel_mixer, register_token_mixer
from tpzoo.models.kinds.mlp import MLP
from tpzoo.models.kinds.moe import MoE
from tpzoo.models.kinds.rotary import RotarySpec
from tpzoo.models.mla import LatentAttention, MLAConfig
from tpzoo.parallel import ParallelDims
from tpzoo.plan.kinds import COSTS, register_cost
from tpzoo.plan.kinds.gated_deltanet import GatedDeltaNetCost
from tpzoo.plan.kinds.mla import MLACost
from tpzoo.plan.kinds.moe import MoECost


@dataclass(frozen=True)
class SharedMoEConfig(MoEConfig):
    """MoEConfig with the shared experts' width as the frontier / hybrid branches add it."""
    shared_expert_ffn: int = 0


@dataclass
class KindsConfig(ModelConfig):
    """A ModelConfig with the sub-configs issue 32/33 phase 2 add (their field names as proposed)."""
    mla: MLAConfig | None = None
    gated_deltanet: GatedDeltaNetConfig | None = None


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class MLAKind(nn.Module):
    """Token mixer over LatentAttention (rotary tables of qk_rope_head_dim at the attention settings, as the "mla"
    kind builds them; no YaRN here)."""

    def __init__(self, cfg, layer: int, layout):
        super().__init__()
        self.inner = LatentAttention(cfg.mla, layout.dims, layout.sequence_parallel, dtype=layout.dtype,
                                     device="meta")
        self.rotary = RotarySpec.of(cfg.mla.qk_rope_head_dim, cfg.attention.rope_theta, cfg.attention.rope_scaling)

    def forward(self, x, ctx, cache=None):
        cos, sin = ctx.rotary[self.rotary]
        return self.inner(x, cos, sin)

    @staticmethod
    def num_parameters(cfg, layer: int, active: bool = False) -> int:
        return _count(LatentAttention(cfg.mla, ParallelDims.for_rank(device="meta"), device="meta"))

    @staticmethod
    def sequence_flops(cfg, layer: int, seq_len: int) -> int:
        m = cfg.mla
        return 2 * seq_len * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)


class GDNKind(nn.Module):
    """Token mixer over GatedDeltaNet."""
    rotary = None

    def __init__(self, cfg, layer: int, layout):
        super().__init__()
        self.inner = GatedDeltaNet(cfg.gated_deltanet, layout.dims, layout.sequence_parallel, dtype=layout.dtype,
                                   device="meta")

    def forward(self, x, ctx, cache=None):
        return self.inner(x)

    def new_cache(self, batch: int, max_length: int):
        return None  # the building block's own cache is tested on the block (test_plan_kinds)

    @staticmethod
    def num_parameters(cfg, layer: int, active: bool = False) -> int:
        return _count(GatedDeltaNet(cfg.gated_deltanet, ParallelDims.for_rank(device="meta"), device="meta"))

    @staticmethod
    def sequence_flops(cfg, layer: int, seq_len: int) -> int:
        return 0


class SharedMoEKind(nn.Module):
    """Channel mixer: main's MoE plus shared experts as those branches compute them, a dense MLP of
    moe.shared_expert_ffn on the same input (its own TP entry and exit), added to the routed output."""
    aux_rules = MoE.aux_rules

    def __init__(self, cfg, layer: int, layout):
        super().__init__()
        self.routed = MoE(cfg, layer, layout)
        self.shared_experts = MLP(cfg.replace(ffn_hidden_size=cfg.moe.shared_expert_ffn), layer, layout)

    def forward(self, x, ctx):
        return self.routed(x, ctx) + self.shared_experts(x)

    @staticmethod
    def num_parameters(cfg, layer: int, active: bool = False) -> int:
        return (MoE.num_parameters(cfg, layer, active)
                + MLP.num_parameters(cfg.replace(ffn_hidden_size=cfg.moe.shared_expert_ffn), layer))


for _name, _kind, _cost in (("test_mla", MLAKind, MLACost), ("test_gdn", GDNKind, GatedDeltaNetCost)):
    if _name not in TOKEN_MIXERS:
        register_token_mixer(_name, _kind)
    if _name not in COSTS:
        register_cost(_name)(_cost)
if "test_moe_shared" not in CHANNEL_MIXERS:
    register_channel_mixer("test_moe_shared", SharedMoEKind)
    register_cost("test_moe_shared")(MoECost)


def mla_model(q_lora: bool = True, v_head_dim: int = 12, layers: int = 2, **kw) -> KindsConfig:
    """A small model of MLA layers (heads 4, qk 16 + 8, latents 32 / 24) with dense MLPs."""
    m = MLAConfig(hidden_size=64, num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=v_head_dim, q_lora_rank=24 if q_lora else None, attention_bias=q_lora)
    return KindsConfig.from_dict(dict(family="test", vocab_size=101, hidden_size=64, num_layers=layers, num_heads=4,
                                      ffn_hidden_size=96, max_position_embeddings=256,
                                      token_mixers=["test_mla"] * layers, name="test-mla", **kw)).replace(mla=m)


def hybrid_model(layers: int = 4, **kw) -> KindsConfig:
    """Three Gated DeltaNet layers before each attention layer (Qwen3.5's pattern), value heads twice the key
    heads."""
    g = GatedDeltaNetConfig(64, num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6, conv_kernel=4)
    kinds = ["test_gdn" if (i + 1) % 4 else "attention" for i in range(layers)]
    return KindsConfig.from_dict(dict(family="test", vocab_size=101, hidden_size=64, num_layers=layers, num_heads=4,
                                      num_kv_heads=2, ffn_hidden_size=96, max_position_embeddings=256,
                                      token_mixers=kinds, name="test-hybrid", **kw)).replace(gated_deltanet=g)


def shared_moe_model(layers: int = 2, **kw) -> KindsConfig:
    """DeepSeekMoE's shape on main's MoE: a dense first layer, then 8 experts (top 2, ffn 16) beside shared
    experts of width 32, under latent attention."""
    cfg = mla_model(layers=layers, **kw)
    moe = SharedMoEConfig(num_experts=8, num_experts_per_tok=2, ffn_hidden_size=16, shared_expert_ffn=32)
    return cfg.replace(moe=moe, channel_mixers=["mlp"] + ["test_moe_shared"] * (layers - 1), name="test-shared-moe")
