"""ModelConfig: one documented dataclass describing every decoder-only model of the zoo.

The model-wide shape (vocabulary, width, depth, norms, embeddings, head) sits at the top level; each layer kind's
settings sit in their own frozen sub-config: `attention` (softmax attention and its positions), `mlp` (the dense
MLP), `moe` (the mixture of experts; num_experts 0: none), `gated_deltanet` and `kimi_delta` (linear attention; None: no
such layer).
Which kind each layer runs is per layer:
`token_mixer(i)` and `channel_mixer(i)` (explicit lists `token_mixers` / `channel_mixers`, or, when they are None,
the rules HF configs use: every layer attention; a mixture of experts where `moe.num_experts` is set, except
Qwen3-MoE's `mlp_only_layers` and off `decoder_sparse_step`). A family file reads HF's config into these
(models/hf_common.py); nothing dispatches on the family's name.

Older tpzoo checkpoints and scripts spell every setting flat (`num_heads`, `ffn_hidden_size`, `num_experts`,
`attn_softcap`, ...): `ModelConfig.from_dict` and `replace` take those names (FLAT below says where each lives),
and the flat names read as properties. New kinds' settings get a sub-config of their own, never a flat name.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass, field

from tpzoo.errors import ConfigError

from .registry import layer_kinds

LAYER_TYPES = ("full_attention", "sliding_attention")  # HF's names for a layer's attention window
GATED = ("swiglu", "geglu_tanh")  # activations whose MLP input projection is gate|up fused


@dataclass(frozen=True)
class AttentionConfig:
    """Softmax attention (models/kinds/attention.py) and its rotary positions."""
    num_heads: int
    num_kv_heads: int | None = None  # grouped-query attention; None = num_heads (multi-head)
    head_dim: int | None = None      # None = hidden_size // num_heads
    qkv_bias: bool = False           # Qwen2, GPT-2: True
    out_bias: bool = False           # output projection bias (GPT-2)
    qk_norm: str = "none"            # "none" | "head" (RMSNorm over head_dim: Qwen3, Gemma 3) | "full" (over all
                                     # heads' width: OLMo 2; under TP the sum of squares is all-reduced)
    scale: float | None = None       # Gemma's query_pre_attn_scalar: scores scaled by scale**-0.5 (None: head_dim)
    softcap: float | None = None     # Gemma 2: scores -> cap * tanh(scores / cap)
    sliding_window: int | None = None  # Mistral: attend to at most this many previous tokens
    # Per-layer window ("full_attention" | "sliding_attention", HF's `layer_types`); None = every layer slides when
    # sliding_window is set (Mistral). Gemma 2 alternates, Gemma 3 has 5 sliding to 1 full.
    layer_types: list | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_scaling, e.g. Llama 3.1 {"rope_type": "llama3", "factor": 8, ...}
    partial_rotary_factor: float = 1.0  # Phi-4-mini: 0.75, rotary on the first head_dim * factor dims of q and k
    rope_local_theta: float | None = None  # Gemma 3: the rope base of sliding layers (None: rope_theta everywhere)
    rope_layers: list | None = None  # SmolLM3: per-layer 1/0, whether the layer applies rope (None: every layer)
    sinks: bool = False              # gpt-oss: a learned sink logit per head joins every softmax row (`attn.sinks`)
    output_gate: bool = False        # Qwen3.5 / Qwen3-Next: q's projection is twice as wide, each head's query then
                                     # its gate; the output is scaled by sigmoid(gate) before the out projection

    def window(self, i: int) -> int | None:
        """The sliding window of layer i (None: full causal attention). A layer past `layer_types` (a
        multi-token-prediction block: ModelConfig.mtp) attends to the whole context, as the published ones do."""
        if self.layer_types is None:
            return self.sliding_window
        if i < len(self.layer_types) and self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each q/k head the rotary turns (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass(frozen=True)
class MLPConfig:
    """The dense MLP (models/kinds/mlp.py); its activation is also the experts' (models/kinds/moe.py)."""
    ffn_hidden_size: int
    activation: str = "swiglu"       # "swiglu" | "geglu_tanh" (Gemma: gelu_tanh(gate) * up; both gate|up fused)
                                     # | "gelu_tanh"
    bias: bool = False               # GPT-2: True

    @property
    def gated(self) -> bool:
        return self.activation in GATED


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts (models/kinds/moe.py) on the layers whose channel mixer is "moe"."""
    num_experts: int = 0             # 0: dense. Mixtral num_local_experts, Qwen3-MoE / OLMoE num_experts
    num_experts_per_tok: int = 0     # top-k experts per token
    ffn_hidden_size: int | None = None  # each expert's hidden size (None: the MLP's); Qwen3-MoE moe_intermediate_size
    norm_topk_prob: bool = True      # renormalize the top-k probabilities to sum to 1 (Mixtral: always)
    router_aux_loss_coef: float = 0.0   # HF's load-balancing loss weight, added to the loss when
    output_router_logits: bool = False  # output_router_logits is set (HF's semantics; off in published configs)
    router_z_loss_coef: float = 0.0  # ST-MoE router z-loss weight (mean logsumexp(logits)^2 per layer, summed)
    mlp_only_layers: list | None = None  # Qwen3-MoE: layers that keep a dense MLP
    decoder_sparse_step: int = 1     # Qwen3-MoE: layer i is MoE when (i + 1) % step == 0
    # Shared experts: one dense gated MLP beside the routed experts, every token through it (TP-split like the dense
    # MLP). Its total hidden size: DeepSeek n_shared_experts * moe_intermediate_size, Qwen3-Next
    # shared_expert_intermediate_size; 0 = none. shared_expert_gate (Qwen3-Next): its output times
    # sigmoid(x w^T), w [1, hidden] without bias.
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = False
    # The router (models/kinds/routers.py): "softmax" (Mixtral, Qwen), "sigmoid" (DeepSeek-V3, GLM-4.5: sigmoid scores,
    # the selection bias e_score_correction_bias, group-limited: only topk_group of n_group groups of experts
    # compete; the weights times routed_scaling_factor), "topk_softmax" (gpt-oss: top-k of the logits, softmax
    # over the k; router_bias: the router linear's bias).
    router: str = "softmax"
    router_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Auxiliary-loss-free balancing (sigmoid router): after each optimizer step the selection bias moves by this
    # times sign(mean load - expert load), the loads of the whole step on every rank; 0 freezes it. Training sets it
    # from --router-bias-update-rate.
    bias_update_rate: float = 1e-3
    expert_bias: bool = False        # gpt-oss: every expert's gate|up and down biases
    swiglu_limit: float | None = None  # gpt-oss: the experts' clamped SwiGLU, (up + 1) * gate * sigmoid(alpha gate)
    swiglu_alpha: float = 1.702


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (models/kinds/mla.py: DeepSeek-V2/V3, Kimi K2, Moonlight), HF DeepseekV3Config's
    names. Its heads, biases and rotary (theta, YaRN scaling) are the attention sub-config's."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None   # None: one q_proj instead of q_a_proj -> q_a_layernorm -> q_b_proj
    rope_interleave: bool = True     # DeepSeek's interleaved rotary pairs (models/rope.py)
    latent_norm_eps: float = 1e-6    # q_a_layernorm / kv_a_layernorm (HF builds them with the default eps)
    # Mistral Small 4 (Llama 4's long-context temperature): queries times 1 + beta * log(1 + floor(position /
    # length)) at each token's position; None: off. HF's rope_parameters llama_4_scaling_beta and
    # original_max_position_embeddings.
    query_scale_beta: float | None = None
    query_scale_length: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class SparseMLAConfig:
    """DeepSeek Sparse Attention (models/kinds/sparse_mla.py: DeepSeek-V3.2, GLM-5): the lightning indexer of each
    "sparse_mla" layer, HF's names (its attention is MLA: cfg.mla). The indexer's queries read q_a_layernorm's
    output (x when q_lora_rank is None), its keys and head weights x."""
    index_topk: int                  # keys each query attends to (HF index_topk)
    index_n_heads: int               # the indexer's heads (HF index_n_heads)
    index_head_dim: int              # their width; the first qk_rope_head_dim dims rotate (HF index_head_dim)
    rope_interleave: bool = False    # the indexer's rotary: DeepSeek-V3.2 half-split, GLM-5 interleaved pairs
    # Per layer: "full" runs its own indexer, "shared" (GLM-5's cross-layer sharing) reuses the top-k of the nearest
    # full layer before it and holds no indexer weights (HF's indexer_types); None: every layer full.
    indexer_types: list | None = None
    k_norm_eps: float = 1e-6         # the indexer's key LayerNorm
    # Training (run settings: --dsa-indexer-loss-scale, --dsa-indexer-sparse-loss): 0 keeps the indexer frozen (its
    # weights get no gradient, as in HF); > 0 trains it with the KL divergence from the main attention's
    # distribution to the indexer's, times this (DeepSeek-V3.2's L_I, Megatron-Core's dsa_indexer_loss_coeff).
    # sparse_loss: both distributions over the selected keys only (else over every visible key).
    indexer_loss_scale: float = 0.0
    sparse_loss: bool = False

    def __post_init__(self):
        for name in ("index_topk", "index_n_heads", "index_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigError(f"sparse_mla.{name} must be a positive integer, got {value!r}")
        if self.indexer_types is not None:
            object.__setattr__(self, "indexer_types", list(self.indexer_types))
            if not set(self.indexer_types) <= {"full", "shared"}:
                raise ConfigError(f"sparse_mla.indexer_types entries must be 'full' or 'shared', got "
                                  f"{sorted(set(self.indexer_types))}")
        if self.indexer_loss_scale < 0:
            raise ConfigError(f"sparse_mla.indexer_loss_scale must be >= 0, got {self.indexer_loss_scale!r}")

    def has_indexer(self, layer: int) -> bool:
        """Whether layer `layer` runs an indexer of its own (else it reuses an earlier layer's top-k)."""
        return self.indexer_types is None or self.indexer_types[layer] == "full"

    def source_layer(self, layer: int) -> int:
        """The layer whose top-k layer `layer` uses: itself, or the nearest full layer before it."""
        source = layer
        while not self.has_indexer(source):
            source -= 1
            if source < 0:
                raise ConfigError(f"sparse_mla.indexer_types: layer {layer} shares a top-k, but no layer before it "
                                  f"runs an indexer")
        return source


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Gated DeltaNet (models/kinds/gated_deltanet.py), the linear attention of Qwen3.5 / Qwen3-Next (HF's
    linear_* fields). Its norm's eps is the model's norm_eps, its init std the model's initializer_range."""
    num_key_heads: int               # HF linear_num_key_heads
    num_value_heads: int             # HF linear_num_value_heads (a multiple of the key heads)
    key_head_dim: int                # HF linear_key_head_dim
    value_head_dim: int              # HF linear_value_head_dim
    conv_kernel: int = 4             # HF linear_conv_kernel_dim: the causal depthwise conv's taps
    chunk_size: int = 64             # the chunked (WY) form's chunk (kernels/gated_delta.py)

    def __post_init__(self):
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel",
                     "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigError(f"gated_deltanet.{name} must be a positive integer, got {value!r}")
        if self.num_value_heads % self.num_key_heads:
            raise ConfigError(f"gated_deltanet: num_value_heads={self.num_value_heads} is not a multiple of "
                              f"num_key_heads={self.num_key_heads}")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_parts(self) -> tuple[int, ...]:
        return self.key_dim, self.key_dim, self.value_dim  # q | k | v

    @property
    def in_proj_parts(self) -> tuple[int, ...]:
        return (*self.conv_parts, self.value_dim, self.num_value_heads, self.num_value_heads)  # .. | z | b | a


@dataclass(frozen=True)
class MTPConfig:
    """Multi-token prediction (models/mtp.py; DeepSeek-V3 report section 2.2): `num_layers` depths after the main
    model, depth k predicting token i+k+1 from [norm(Emb(t_{i+k})); norm(h^{k-1}_i)] through a projection, one
    block of the model's own kinds (layer index num_layers + k - 1: `token_mixer` / `channel_mixer`, None: the
    last main layer's) and its own final norm, the embedding and the head shared with the main model.
    `loss_scale`: the weight S of the mean over depths in the training loss (the family's published default;
    --mtp-loss-scale overrides it). `hf_copies`: the Hugging Face checkpoint keeps each depth's own copies of the
    embedding and the head (DeepSeek-V3's model.layers.61.embed_tokens / shared_head.head): written on export."""
    num_layers: int = 1
    token_mixer: str | None = None
    channel_mixer: str | None = None
    loss_scale: float = 0.1
    hf_copies: bool = True

    def __post_init__(self):
        n = self.num_layers
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ConfigError(f"mtp.num_layers must be a positive integer, got {n!r}")
        if not isinstance(self.loss_scale, numbers.Real) or self.loss_scale < 0:
            raise ConfigError(f"mtp.loss_scale must be >= 0, got {self.loss_scale!r}")


@dataclass(frozen=True)
class KimiDeltaConfig:
    """Kimi Delta Attention (models/kinds/kimi_delta.py), the linear attention of Kimi Linear (HF's
    linear_attn_config, or transformers' linear_* fields): q, k, v of num_heads heads of head_dim each (d_k = d_v), a
    decay per key channel. Its norm's eps is the model's norm_eps, its init std the model's initializer_range."""
    num_heads: int                   # HF linear_attn_config.num_heads (linear_num_heads)
    head_dim: int                    # HF linear_attn_config.head_dim (linear_head_dim); also the rank of the decay's
                                     # and the output gate's low-rank projections (f_a_proj, g_a_proj)
    conv_kernel: int = 4             # HF short_conv_kernel_size (linear_conv_kernel_dim)
    chunk_size: int = 64             # the chunked (WY) form's chunk (kernels/gated_delta.py)

    def __post_init__(self):
        for name in ("num_heads", "head_dim", "conv_kernel", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigError(f"kimi_delta.{name} must be a positive integer, got {value!r}")

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_parts(self) -> tuple[int, ...]:
        return self.dim, self.dim, self.dim  # q | k | v

    @property
    def in_proj_parts(self) -> tuple[int, ...]:
        return (*self.conv_parts, self.num_heads)  # q | k | v | b (beta's logits)


# The flat spellings of older configs: name -> (sub-config, its field).
FLAT = {
    **{n: ("attention", n) for n in ("num_heads", "num_kv_heads", "head_dim", "qkv_bias", "out_bias", "qk_norm",
                                     "sliding_window", "layer_types", "rope_theta", "rope_scaling",
                                     "partial_rotary_factor", "rope_local_theta", "rope_layers")},
    "attn_scale": ("attention", "scale"), "attn_softcap": ("attention", "softcap"),
    "ffn_hidden_size": ("mlp", "ffn_hidden_size"), "activation": ("mlp", "activation"), "mlp_bias": ("mlp", "bias"),
    **{n: ("moe", n) for n in ("num_experts", "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef",
                               "output_router_logits", "router_z_loss_coef", "mlp_only_layers",
                               "decoder_sparse_step")},
    "moe_ffn_hidden_size": ("moe", "ffn_hidden_size"),
}
# Each kind's settings: a frozen dataclass in a ModelConfig field of the same name (a new kind adds its own here,
# with a default, e.g. None when the model has no such layer); attention's and the MLP's are required.
SUBCONFIGS = {"attention": AttentionConfig, "mlp": MLPConfig, "moe": MoEConfig, "mla": MLAConfig,
              "gated_deltanet": GatedDeltaNetConfig, "kimi_delta": KimiDeltaConfig, "sparse_mla": SparseMLAConfig,
              "mtp": MTPConfig}
REQUIRED = ("attention", "mlp")
_POSITIVE = (("vocab_size", None), ("hidden_size", None), ("num_layers", None), ("max_position_embeddings", None),
             ("num_heads", "attention"), ("num_kv_heads", "attention"), ("head_dim", "attention"),
             ("sliding_window", "attention"), ("ffn_hidden_size", "mlp"))
_OPTIONAL = ("num_kv_heads", "head_dim", "sliding_window")  # None = derived / off


@dataclass
class ModelConfig:
    family: str                      # a registered family: "gpt2", "llama", "mistral", "qwen2", ...
    vocab_size: int
    hidden_size: int
    num_layers: int
    attention: AttentionConfig
    mlp: MLPConfig
    moe: MoEConfig = field(default_factory=MoEConfig)
    mla: MLAConfig | None = None     # the "mla" token mixer's settings (None: no such layer)
    gated_deltanet: GatedDeltaNetConfig | None = None  # the "gated_deltanet" token mixer's
    kimi_delta: KimiDeltaConfig | None = None  # the "kimi_delta" token mixer's
    sparse_mla: SparseMLAConfig | None = None  # the "sparse_mla" token mixer's indexer (its attention: mla)
    mtp: MTPConfig | None = None     # multi-token-prediction depths after the main model (None: none)
    # Per-layer kinds (registered names: models/kinds): None = the rules above.
    token_mixers: list | None = None    # "attention" | "mla" | "gated_deltanet" | "kimi_delta" | "sparse_mla"
    channel_mixers: list | None = None  # "mlp" | "moe"
    max_position_embeddings: int = 2048
    norm: str = "rmsnorm"            # "rmsnorm" | "layernorm"
    norm_eps: float = 1e-5
    position: str = "rope"           # "rope" (applied by the token mixers) | "learned" (added to the embeddings)
                                     # | "none" (no positions: Kimi Linear's NoPE latent attention)
    tie_embeddings: bool = False
    # Block shape. pre_norm: norm before the token / channel mixer (attn_norm, mlp_norm); post_norm: norm of their
    # output before the residual add (post_attn_norm, post_mlp_norm). OLMo 2: post only; Gemma 2/3: both.
    pre_norm: bool = True
    post_norm: bool = False
    norm_offset: bool = False        # Gemma: RMSNorm scales by (1 + weight), weights start at 0
    embed_scale: bool = False        # Gemma: embeddings multiplied by sqrt(hidden_size)
    final_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap) (elementwise: vocab-parallel)
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    pad_token_id: int | None = None
    name: str = ""                   # registry name, when it came from the registry
    hf_source: str = ""              # the Hugging Face repository these shapes come from
    extra: dict = field(default_factory=dict)  # family-specific HF fields kept for the round trip
    # The tensors kept quantized (convert from-hf --keep-quantized; tpzoo.quant): {"format": "fp8_block" |
    # "int4_pack", its block / group, "tensors": [tpzoo names], "hf": the source's quantization_config}
    quantization: dict | None = None

    def __post_init__(self):
        # Shapes first: a zero or a string from a hand-edited config.json would otherwise surface as a division
        # by zero or a TypeError deep inside model construction.
        for attr, group in _POSITIVE:
            value = getattr(self if group is None else getattr(self, group), attr)
            if value is None and attr in _OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigError(f"{attr} must be a positive integer, got {value!r}")
        if not isinstance(self.norm_eps, numbers.Real) or not self.norm_eps > 0:
            raise ConfigError(f"norm_eps must be > 0, got {self.norm_eps!r}")
        self.attention = self._resolved_attention(self.attention)
        self.moe = dataclasses.replace(self.moe, **_listed(self.moe, ("mlp_only_layers",)))
        for attr, allowed in (("norm", ("rmsnorm", "layernorm")), ("position", ("rope", "learned", "none"))):
            if getattr(self, attr) not in allowed:
                raise ConfigError(f"{attr} must be one of {allowed}, got {getattr(self, attr)!r}")
        if self.mlp.activation not in ("swiglu", "geglu_tanh", "gelu_tanh"):
            raise ConfigError(f"activation must be one of ('swiglu', 'geglu_tanh', 'gelu_tanh'), got "
                              f"{self.mlp.activation!r}")
        for attr in ("token_mixers", "channel_mixers"):
            value = getattr(self, attr)
            if value is not None:
                setattr(self, attr, value := list(value))
                if len(value) != self.num_layers or not all(isinstance(k, str) for k in value):
                    raise ConfigError(f"{attr} must name one kind per layer ({self.num_layers}), got {value!r}")
        moe = self.moe
        if moe.num_experts:
            if not 1 <= moe.num_experts_per_tok <= moe.num_experts:
                raise ConfigError(f"num_experts_per_tok (top-k) must be in [1, num_experts={moe.num_experts}], got "
                                  f"{moe.num_experts_per_tok!r}")
            if not self.gated:
                raise ConfigError("mixture of experts: only gated (swiglu / geglu_tanh) experts are implemented")
        if moe.router not in ("softmax", "sigmoid", "topk_softmax"):
            raise ConfigError(f"moe.router must be one of ('softmax', 'sigmoid', 'topk_softmax'), got {moe.router!r}")
        if moe.num_experts and (moe.n_group < 1 or moe.num_experts % moe.n_group
                                or not 1 <= moe.topk_group <= moe.n_group):
            raise ConfigError(f"moe: n_group={moe.n_group} must divide num_experts={moe.num_experts} and "
                              f"topk_group={moe.topk_group} lie in [1, n_group]")
        if moe.bias_update_rate < 0:
            raise ConfigError(f"moe.bias_update_rate must be >= 0, got {moe.bias_update_rate!r}")
        if moe.shared_expert_ffn < 0 or (moe.shared_expert_gate and not moe.shared_expert_ffn):
            raise ConfigError(f"shared_expert_ffn must be >= 0 (and > 0 with shared_expert_gate), got "
                              f"{moe.shared_expert_ffn!r}")
        if "moe" in (self.channel_mixers or ()) and not moe.num_experts:
            raise ConfigError("channel_mixers names 'moe' layers, but moe.num_experts is 0")
        kinds = set(self.token_mixers or ()) | ({self.mtp.token_mixer} if self.mtp else set())
        for kind in kinds & set(SUBCONFIGS):  # a kind with its own settings needs them
            if getattr(self, kind) is None:
                raise ConfigError(f"token_mixers names {kind!r} layers, but the config has no {kind} settings")
        if self.mtp is not None and self.mtp.channel_mixer == "moe" and not moe.num_experts:
            raise ConfigError("mtp.channel_mixer is 'moe', but moe.num_experts is 0")
        if self.norm_offset and self.norm != "rmsnorm":
            raise ConfigError("norm_offset (1 + weight) is only defined for rmsnorm")

    def _resolved_attention(self, a: AttentionConfig) -> AttentionConfig:
        """num_kv_heads and head_dim filled in, per-layer lists checked."""
        changes = _listed(a, ("layer_types", "rope_layers"))
        if a.num_kv_heads is None:
            changes["num_kv_heads"] = a.num_heads
        if a.head_dim is None:
            if self.hidden_size % a.num_heads:
                raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by num_heads {a.num_heads}")
            changes["head_dim"] = self.hidden_size // a.num_heads
        a = dataclasses.replace(a, **changes)
        if a.num_heads % a.num_kv_heads:
            raise ConfigError(f"num_heads {a.num_heads} is not divisible by num_kv_heads {a.num_kv_heads}")
        if a.qk_norm not in ("none", "head", "full"):
            raise ConfigError(f"qk_norm must be one of ('none', 'head', 'full'), got {a.qk_norm!r}")
        for attr in ("layer_types", "rope_layers"):
            value = getattr(a, attr)
            if value is not None and len(value) != self.num_layers:
                raise ConfigError(f"{attr} has {len(value)} entries for {self.num_layers} layers")
        if a.layer_types is not None and not set(a.layer_types) <= set(LAYER_TYPES):
            raise ConfigError(f"layer_types entries must be one of {LAYER_TYPES}, got {sorted(set(a.layer_types))}")
        if not 0 < a.partial_rotary_factor <= 1 or a.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor {a.partial_rotary_factor} must give an even rotary dim "
                              f"in (0, head_dim={a.head_dim}]")
        return a

    # -- layer kinds --------------------------------------------------------------------------------------------
    # Layers num_layers .. num_layers + mtp_depths - 1 are the multi-token-prediction blocks (their HF index too).
    @property
    def mtp_depths(self) -> int:
        return self.mtp.num_layers if self.mtp is not None else 0

    def token_mixer(self, i: int) -> str:
        """The registered token-mixer kind of layer i (models/kinds)."""
        if i >= self.num_layers:
            return self.mtp.token_mixer or self.token_mixer(self.num_layers - 1)
        return self.token_mixers[i] if self.token_mixers is not None else "attention"

    def channel_mixer(self, i: int) -> str:
        """The registered channel-mixer kind of layer i: Qwen3-MoE's rule (mlp_only_layers, decoder_sparse_step)
        unless channel_mixers lists them."""
        if i >= self.num_layers:
            return self.mtp.channel_mixer or self.channel_mixer(self.num_layers - 1)
        if self.channel_mixers is not None:
            return self.channel_mixers[i]
        moe = self.moe
        sparse = (moe.num_experts > 0 and i not in (moe.mlp_only_layers or ())
                  and (i + 1) % moe.decoder_sparse_step == 0)
        return "moe" if sparse else "mlp"

    def reads_layer(self, i: int) -> int:
        """The earliest layer whose result of the same forward layer i reads besides its input: i itself, or what
        its token mixer kind says (`reads_layer`: a GLM-5 shared sparse attention layer reads the selection of the
        layer it shares). A pipeline stage holds both (tpzoo/pipeline/partition.py)."""
        kind = layer_kinds(self, i)[0]
        return kind.reads_layer(self, i) if hasattr(kind, "reads_layer") else i

    def is_moe_layer(self, i: int) -> bool:
        return self.channel_mixer(i) == "moe"

    @property
    def expert_ffn(self) -> int:
        return self.moe.ffn_hidden_size or self.mlp.ffn_hidden_size

    @property
    def gated(self) -> bool:
        return self.mlp.gated

    # -- serialization ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """From to_dict()'s nested form, or the flat one of older checkpoints (FLAT), or a mix of the two."""
        top = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - top - set(FLAT)
        if unknown:
            raise ConfigError(f"unknown ModelConfig fields: {sorted(unknown)}")
        kw = {k: v for k, v in d.items() if k in top and k not in SUBCONFIGS}
        groups = {}
        for g, kind in SUBCONFIGS.items():
            value = d.get(g) or {}
            if isinstance(value, kind):
                value = dataclasses.asdict(value)
            if not isinstance(value, dict):
                raise ConfigError(f"ModelConfig.{g} must be an object, got {value!r}")
            groups[g] = dict(value)
        for flat, (g, name) in FLAT.items():
            if flat in d:
                if name in groups[g] and groups[g][name] != d[flat]:
                    raise ConfigError(f"ModelConfig: {flat}={d[flat]!r} contradicts {g}.{name}={groups[g][name]!r}")
                groups[g][name] = d[flat]
        for g, values in groups.items():
            allowed = {f.name for f in dataclasses.fields(SUBCONFIGS[g])}
            if set(values) - allowed:
                raise ConfigError(f"unknown ModelConfig.{g} fields: {sorted(set(values) - allowed)}")
        for g in REQUIRED:
            if not groups[g]:
                raise ConfigError(f"ModelConfig needs its {g} settings ({g}: {{...}}, or the flat fields)")
        # an optional kind's settings absent (or null): the field's default
        return cls(**kw, **{g: SUBCONFIGS[g](**values) for g, values in groups.items() if values or g in REQUIRED})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes`: top-level fields, whole sub-configs, or the flat names of FLAT."""
        groups: dict[str, dict] = {}
        for name in [n for n in changes if n in FLAT]:
            g, field_name = FLAT[name]
            groups.setdefault(g, {})[field_name] = changes.pop(name)
        for g, values in groups.items():
            changes[g] = dataclasses.replace(changes.get(g, getattr(self, g)), **values)
        return dataclasses.replace(self, **changes)

    # -- sizes --------------------------------------------------------------------------------------------------
    def num_parameters(self, include_embeddings: bool = True, active: bool = False) -> int:
        """Exact parameter count of the full (unsharded, unpadded) model; with `active`, the parameters one token
        uses (a MoE layer's router and top-k of its experts). Each layer's mixers count their own
        (models/kinds: `num_parameters(cfg, layer, active)`)."""
        h = self.hidden_size
        total = h * (2 if self.norm == "layernorm" else 1) + sum(self.layer_parameters(active))  # + the final norm
        total += self.mtp_parameters(active)
        if include_embeddings:
            total += self.vocab_size * h * (1 if self.tie_embeddings else 2)
            if self.position == "learned":
                total += self.max_position_embeddings * h
        return total

    def layer_parameters(self, active: bool = False) -> list[int]:
        """Parameters of each transformer layer: its norms and what its token and channel mixer kinds count (so a
        dense and an MoE layer, or a Gated DeltaNet and an attention layer, weigh what they hold)."""
        norm = self.hidden_size * (2 if self.norm == "layernorm" else 1)
        norms = 2 * (int(self.pre_norm) + int(self.post_norm)) * norm
        return [norms + sum(kind.num_parameters(self, i, active) for kind in layer_kinds(self, i))
                for i in range(self.num_layers)]

    def mtp_parameters(self, active: bool = False) -> int:
        """Parameters of the multi-token-prediction depths (0 without): each its block, its three norms and its
        projection from 2h to h (the embedding and head are the main model's)."""
        h, norm = self.hidden_size, self.hidden_size * (2 if self.norm == "layernorm" else 1)
        block = 2 * (int(self.pre_norm) + int(self.post_norm)) * norm
        return sum(block + 3 * norm + 2 * h * h + sum(kind.num_parameters(self, i, active)
                                                          for kind in layer_kinds(self, i))
                   for i in range(self.num_layers, self.num_layers + self.mtp_depths))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward): matmuls, and each token mixer's own work
        over the sequence (attention: QK^T and AV, causal not discounted)."""
        # (multi-token prediction: its depths' parameters, and the head once per depth)
        heads = 1 + self.mtp_depths
        matmul_params = (self.num_parameters(include_embeddings=False, active=True)
                         + heads * self.vocab_size * self.hidden_size)
        mixing = sum(layer_kinds(self, i)[0].sequence_flops(self, i, seq_len)
                     for i in range(self.num_layers + self.mtp_depths))
        return 3 * (2 * matmul_params + mixing)


def _listed(sub, attrs) -> dict:
    """Per-layer list fields of a sub-config as lists (JSON and tuples alike)."""
    return {a: list(getattr(sub, a)) for a in attrs if getattr(sub, a) is not None}


def _flat_property(group: str, name: str):
    return property(lambda self: getattr(getattr(self, group), name),
                    doc=f"The flat spelling of {group}.{name} (read-only; older configs and checkpoints).")


for _flat, (_group, _name) in FLAT.items():
    setattr(ModelConfig, _flat, _flat_property(_group, _name))
