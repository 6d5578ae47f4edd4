"""Test-only layer kinds for the plan's costs (tpzoo/plan/kinds): the Gated DeltaNet kind
(models/kinds/gated_deltanet.py, issue 33) registered again under a test name with the plan's "gated_deltanet"
costs attached to it (its cache left out); and small models of main's "mla" kind and of its MoE with shared experts
(issue 32).
"""
from __future__ import annotations

from dataclasses import asdict

import torch.nn as nn

from tpzoo.models.config import GatedDeltaNetConfig, MLAConfig, ModelConfig, MoEConfig
from tpzoo.models.kinds import TOKEN_MIXERS, register_token_mixer
from tpzoo.models.kinds.gated_deltanet import GatedDeltaNet
from tpzoo.plan.kinds import COSTS, register_cost
from tpzoo.plan.kinds.gated_deltanet import GatedDeltaNetCost


KindsConfig = ModelConfig  # the name test_plan_kinds.py uses


class GDNKind(nn.Module):
    """Token mixer over GatedDeltaNet."""
    rotary = None

    def __init__(self, cfg, layer: int, layout):
        super().__init__()
        self.inner = GatedDeltaNet(cfg, layer, layout)

    def forward(self, x, ctx, cache=None):
        return self.inner(x)

    def new_cache(self, batch: int, max_length: int):
        return None  # the building block's own cache is tested on the block (test_plan_kinds)

    @staticmethod
    def num_parameters(cfg, layer: int, active: bool = False) -> int:
        return GatedDeltaNet.num_parameters(cfg, layer, active)

    @staticmethod
    def sequence_flops(cfg, layer: int, seq_len: int) -> int:
        return GatedDeltaNet.sequence_flops(cfg, layer, seq_len)


if "test_gdn" not in TOKEN_MIXERS:
    register_token_mixer("test_gdn", GDNKind)
if "test_gdn" not in COSTS:
    register_cost("test_gdn")(GatedDeltaNetCost)



def mla_model(q_lora: bool = True, v_head_dim: int = 12, layers: int = 2, **kw) -> KindsConfig:
    """A small model of main's "mla" layers (heads 4, qk 16 + 8, latents 32 / 24; biases with q_lora) with dense
    MLPs."""
    m = MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=v_head_dim,
                  q_lora_rank=24 if q_lora else None)
    return KindsConfig.from_dict(dict(family="test", vocab_size=101, hidden_size=64, num_layers=layers, num_heads=4,
                                      ffn_hidden_size=96, max_position_embeddings=256, qkv_bias=q_lora,
                                      out_bias=q_lora, token_mixers=["mla"] * layers, name="test-mla",
                                      mla=asdict(m), **kw))


def hybrid_model(layers: int = 4, **kw) -> KindsConfig:
    """Three Gated DeltaNet layers before each attention layer (Qwen3.5's pattern), value heads twice the key
    heads."""
    g = GatedDeltaNetConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6, conv_kernel=4)
    kinds = ["test_gdn" if (i + 1) % 4 else "attention" for i in range(layers)]
    return KindsConfig.from_dict(dict(family="test", vocab_size=101, hidden_size=64, num_layers=layers, num_heads=4,
                                      num_kv_heads=2, ffn_hidden_size=96, max_position_embeddings=256,
                                      token_mixers=kinds, name="test-hybrid", gated_deltanet=asdict(g), **kw))


def shared_moe_model(layers: int = 2, **kw) -> KindsConfig:
    """DeepSeekMoE's shape with main's MoE kind: a dense first layer, then 8 experts (top 2, ffn 16) beside shared
    experts of width 32, under latent attention."""
    cfg = mla_model(layers=layers, **kw)
    moe = MoEConfig(num_experts=8, num_experts_per_tok=2, ffn_hidden_size=16, shared_expert_ffn=32)
    return cfg.replace(moe=moe, channel_mixers=["mlp"] + ["moe"] * (layers - 1), name="test-shared-moe")
