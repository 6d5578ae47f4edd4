"""ModelConfig: one documented dataclass describing every decoder-only model of the zoo."""
from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass, field

from tpzoo.errors import ConfigError


_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size", "num_kv_heads", "head_dim",
                  "max_position_embeddings", "sliding_window")
_OPTIONAL = ("num_kv_heads", "head_dim", "sliding_window")  # None = derived / off
LAYER_TYPES = ("full_attention", "sliding_attention")  # HF's names for a layer's attention kind
GATED = ("swiglu", "geglu_tanh")  # activations whose MLP input projection is gate|up fused


@dataclass
class ModelConfig:
    family: str                      # a registered family: "gpt2", "llama", "mistral", "qwen2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_hidden_size: int
    num_kv_heads: int | None = None  # grouped-query attention; None = num_heads (multi-head)
    head_dim: int | None = None      # None = hidden_size // num_heads
    max_position_embeddings: int = 2048
    norm: str = "rmsnorm"            # "rmsnorm" | "layernorm"
    norm_eps: float = 1e-5
    activation: str = "swiglu"       # "swiglu" | "geglu_tanh" (Gemma: gelu_tanh(gate) * up; both gate|up fused)
                                     # | "gelu_tanh"
    position: str = "rope"           # "rope" | "learned"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_scaling, e.g. Llama 3.1 {"rope_type": "llama3", "factor": 8, ...}
    partial_rotary_factor: float = 1.0  # Phi-4-mini: 0.75, rotary on the first head_dim * factor dims of q and k
    tie_embeddings: bool = False
    qkv_bias: bool = False           # Qwen2: True; GPT-2: True
    out_bias: bool = False           # attention output projection bias (GPT-2)
    mlp_bias: bool = False           # GPT-2: True
    sliding_window: int | None = None  # Mistral: attend to at most this many previous tokens
    # Per-layer attention kinds ("full_attention" | "sliding_attention", HF's `layer_types`); None = every layer
    # is sliding when sliding_window is set (Mistral). Gemma 2 alternates, Gemma 3 has 5 sliding to 1 full.
    layer_types: list | None = None
    rope_local_theta: float | None = None  # Gemma 3: the rope base of sliding layers (None: rope_theta everywhere)
    rope_layers: list | None = None  # SmolLM3: per-layer 1/0, whether the layer applies rope (None: every layer)
    # Block shape. pre_norm: norm before attention / MLP (attn_norm, mlp_norm); post_norm: norm of the attention /
    # MLP output before the residual add (post_attn_norm, post_mlp_norm). OLMo 2: post only; Gemma 2/3: both.
    pre_norm: bool = True
    post_norm: bool = False
    norm_offset: bool = False        # Gemma: RMSNorm scales by (1 + weight), weights start at 0
    qk_norm: str = "none"            # "none" | "head" (RMSNorm over head_dim: Qwen3, Gemma 3) | "full" (over all
                                     # heads' width: OLMo 2; under TP the sum of squares is all-reduced)
    embed_scale: bool = False        # Gemma: embeddings multiplied by sqrt(hidden_size)
    attn_scale: float | None = None  # Gemma's query_pre_attn_scalar: scores scaled by attn_scale**-0.5 (None: head_dim)
    attn_softcap: float | None = None   # Gemma 2: attention scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap) (elementwise: vocab-parallel)
    # Mixture of experts (models/moe.py): num_experts > 0 makes the MLP of the MoE layers a routed set of experts.
    num_experts: int = 0             # 0: dense. Mixtral num_local_experts, Qwen3-MoE / OLMoE num_experts
    num_experts_per_tok: int = 0     # top-k experts per token
    moe_ffn_hidden_size: int | None = None  # each expert's hidden size (None: ffn_hidden_size); Qwen3-MoE's
                                            # moe_intermediate_size
    norm_topk_prob: bool = True      # renormalize the top-k probabilities to sum to 1 (Mixtral: always)
    router_aux_loss_coef: float = 0.0   # HF's load-balancing loss weight, added to the loss when
    output_router_logits: bool = False  # output_router_logits is set (HF's semantics; off in published configs)
    router_z_loss_coef: float = 0.0  # ST-MoE router z-loss weight (mean logsumexp(logits)^2 per layer, summed)
    mlp_only_layers: list | None = None  # Qwen3-MoE: layers that keep a dense MLP
    decoder_sparse_step: int = 1     # Qwen3-MoE: layer i is MoE when (i + 1) % step == 0
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    pad_token_id: int | None = None
    name: str = ""                   # registry name, when it came from the registry
    hf_source: str = ""              # the Hugging Face repository these shapes come from
    extra: dict = field(default_factory=dict)  # family-specific HF fields kept for the round trip

    def __post_init__(self):
        # Shapes first: a zero or a string from a hand-edited config.json would otherwise surface as a division
        # by zero or a TypeError deep inside model construction.
        for attr in _POSITIVE_INTS:
            value = getattr(self, attr)
            if value is None and attr in _OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigError(f"{attr} must be a positive integer, got {value!r}")
        if not isinstance(self.norm_eps, numbers.Real) or not self.norm_eps > 0:
            raise ConfigError(f"norm_eps must be > 0, got {self.norm_eps!r}")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        for attr, allowed in (("norm", ("rmsnorm", "layernorm")), ("activation", ("swiglu", "geglu_tanh", "gelu_tanh")),
                              ("position", ("rope", "learned")), ("qk_norm", ("none", "head", "full"))):
            if getattr(self, attr) not in allowed:
                raise ConfigError(f"{attr} must be one of {allowed}, got {getattr(self, attr)!r}")
        for attr in ("layer_types", "rope_layers"):
            value = getattr(self, attr)
            if value is not None:
                setattr(self, attr, value := list(value))
                if len(value) != self.num_layers:
                    raise ConfigError(f"{attr} has {len(value)} entries for {self.num_layers} layers")
        if self.layer_types is not None and not set(self.layer_types) <= set(LAYER_TYPES):
            raise ConfigError(f"layer_types entries must be one of {LAYER_TYPES}, got {sorted(set(self.layer_types))}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor {self.partial_rotary_factor} must give an even rotary dim "
                              f"in (0, head_dim={self.head_dim}]")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"num_experts_per_tok (top-k) must be in [1, num_experts={self.num_experts}], got "
                                  f"{self.num_experts_per_tok!r}")
            if not self.gated:
                raise ConfigError("mixture of experts: only gated (swiglu / geglu_tanh) experts are implemented")
        if self.norm_offset and self.norm != "rmsnorm":
            raise ConfigError("norm_offset (1 + weight) is only defined for rmsnorm")

    # -- per-layer attention kind -------------------------------------------------------------------------
    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i (None: full causal attention)."""
        if self.layer_types is None or self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_rope(self, i: int) -> str | None:
        """Which rotary table layer i uses: "global", "local" (sliding layers when rope_local_theta is set) or
        None (no rotary: learned positions, or a SmolLM3 no-rope layer)."""
        if self.position != "rope" or (self.rope_layers is not None and not self.rope_layers[i]):
            return None
        if self.rope_local_theta is not None and self.layer_window(i) is not None:
            return "local"
        return "global"

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each q/k head the rotary turns (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts (Qwen3-MoE's mlp_only_layers / decoder_sparse_step)."""
        return (self.num_experts > 0 and i not in (self.mlp_only_layers or ())
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def gated(self) -> bool:
        return self.activation in GATED

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields: {sorted(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_parameters(self, include_embeddings: bool = True, active: bool = False) -> int:
        """Exact parameter count of the full (unsharded, unpadded) model; with `active`, the parameters one token
        uses (a MoE layer's router and top-k of its experts)."""
        h, hd, L = self.hidden_size, self.head_dim, self.num_layers
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        norm = h * (2 if self.norm == "layernorm" else 1)
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0) + (h if self.out_bias else 0)
        attn += {"none": 0, "head": 2 * hd, "full": q + kv}[self.qk_norm]
        n_in = 2 * self.ffn_hidden_size if self.gated else self.ffn_hidden_size
        mlp = h * n_in + self.ffn_hidden_size * h + ((n_in + h) if self.mlp_bias else 0)
        norms_per_layer = 2 * (int(self.pre_norm) + int(self.post_norm))
        moe_layers = sum(self.is_moe_layer(i) for i in range(L))
        expert = 3 * h * self.expert_ffn  # gate, up, down
        moe = h * self.num_experts + expert * (self.num_experts_per_tok if active else self.num_experts)
        total = (L - moe_layers) * mlp + moe_layers * moe + L * (attn + norms_per_layer * norm) + norm
        if include_embeddings:
            total += self.vocab_size * h * (1 if self.tie_embeddings else 2)
            if self.position == "learned":
                total += self.max_position_embeddings * h
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), matmuls and attention scores."""
        h, L = self.hidden_size, self.num_layers
        matmul_params = self.num_parameters(include_embeddings=False, active=True) + self.vocab_size * h
        attn = 2 * 2 * L * seq_len * self.num_heads * self.head_dim  # QK^T and AV, causal not discounted
        return 3 * (2 * matmul_params + attn)
