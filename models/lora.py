"""LoRA on a zoo model: which layers get adapters, named by their Hugging Face projections.

Targets are HF module names as PEFT takes them (`q_proj`, `v_proj`, `down_proj`, GPT-2's `c_attn`...), or
"all-linear" (every linear layer of the transformer blocks, not the output head: PEFT's meaning). Where a name
comes from is the family's own HF tensor map, so every family of the zoo gets LoRA with no per-family code: a
tpzoo weight made of several HF tensors (q|k|v, gate|up) gets one adapter per HF projection, sharded like that
part of the weight. An HF projection may cover several consecutive parts of a tpzoo weight (Qwen3.5's
`in_proj_qkv`: q|k|v of the Gated DeltaNet's in_proj): its adapter spans those parts, sharded like them. A weight
whose HF tensors are a permutation of its rows, not a concatenation (Qwen3-Next's `in_proj_qkvz` / `in_proj_ba`,
grouped per key head), cannot take adapters: targeting it is refused with one line.
`experts` (--lora-experts) adds one adapter per routed expert on each of its stacked weights (models/kinds/
expert_lora.py), beside the linear targets. Their PEFT form (keys, layout, target_modules / target_parameters) is
models/lora_peft.py's; whether PEFT loads an export as written is asked of PEFT itself (checkpoint/peft_check.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from tpzoo.errors import ConfigError
from tpzoo.parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tpzoo.parallel.lora import LoRA

from .kinds.expert_lora import ExpertLoRA, add_expert_lora
from .mtp import block_layer
from .registry import get_family

ALL_LINEAR = "all-linear"


@dataclass
class LoRAConfig:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: list = field(default_factory=lambda: [ALL_LINEAR])
    experts: bool = False  # adapters on every routed expert too (models/kinds/expert_lora.py)

    def __post_init__(self):
        if int(self.rank) != self.rank or self.rank <= 0:
            raise ConfigError(f"lora rank must be a positive integer, got {self.rank}")
        if not self.alpha > 0:
            raise ConfigError(f"lora alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.targets, str):
            self.targets = [self.targets]
        self.targets = [t.strip() for item in self.targets for t in str(item).split(",") if t.strip()]
        if not self.targets and not self.experts:  # (adapters on the experts alone: targets [])
            raise ConfigError("lora targets: give HF projection names (e.g. q_proj,v_proj) or all-linear")
        self.rank, self.alpha, self.experts = int(self.rank), float(self.alpha), bool(self.experts)
        if self.experts and self.dropout:
            raise ConfigError(f"--lora-experts with --lora-dropout {self.dropout:g}: the experts' adapters take no "
                              f"dropout (as PEFT's, whose expert adapters refuse it: x cannot be factored out of "
                              f"B A x); pass --lora-dropout 0")

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets),
                **({"experts": True} if self.experts else {})}

    @classmethod
    def from_dict(cls, d: dict) -> LoRAConfig:
        return cls(d["rank"], d["alpha"], d.get("dropout", 0.0), list(d.get("targets", [ALL_LINEAR])),
                   d.get("experts", False))


@dataclass
class Site:
    """One parallel linear layer of a chunk and the HF modules its weight is made of."""
    module_name: str          # in the chunk, e.g. "layers.3.attn.qkv"
    layer: nn.Module
    hf_modules: list[str]     # e.g. ["model.layers.3.self_attn.q_proj", ...k_proj, ...v_proj]
    groups: list | None = None  # how many consecutive parts of the fused weight each HF module covers (None: one)
    adaptable: bool = True    # False: the HF tensors permute the weight's rows (no adapter can follow them)

    @property
    def short_names(self) -> list[str]:
        return [m.rsplit(".", 1)[-1] for m in self.hf_modules]


def _groups(layer: nn.Module, rows: tuple | None, n_hf: int) -> tuple[list | None, bool]:
    """(parts per HF tensor, adaptable) for a layer whose weight is made of `n_hf` HF tensors of `rows` rows."""
    parts = getattr(layer, "shard_spec", None) and layer.shard_spec.parts
    if n_hf == 1 or (parts is not None and len(parts) == n_hf):
        return None, True
    if rows is None or parts is None:
        return None, False
    groups, i = [], 0
    for want in rows:  # consecutive parts adding up to each HF tensor's rows
        start, total = i, 0
        while total < want and i < len(parts):
            total, i = total + parts[i], i + 1
        if total != want:
            return None, False
        groups.append(i - start)
    return (groups, True) if i == len(parts) else (None, False)


def sites(chunk) -> list[Site]:
    """The linear layers of the chunk's transformer blocks, in module order, with their HF module names."""
    maps = {m.name: m for m in get_family(chunk.cfg.family).hf_tensor_map(chunk.cfg) if not m.mirror}
    out = []
    for name, mod in chunk.named_modules():
        # the blocks' layers, multi-token prediction's depths included (their block and projection)
        if block_layer(name, chunk.cfg.num_layers) is None or not isinstance(
                mod, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
            continue
        if not getattr(mod, "takes_lora", True):  # a layer its kind trains otherwise (models/kinds: the DSA indexer)
            continue
        tm = maps.get(name + ".weight")
        if tm is None or not all(h.endswith(".weight") for h in tm.hf):
            raise ConfigError(f"{chunk.cfg.family}: no Hugging Face mapping for {name}.weight (LoRA names come "
                              f"from it)")
        groups, adaptable = _groups(mod, tm.rows, len(tm.hf))
        out.append(Site(name, mod, [h[: -len(".weight")] for h in tm.hf], groups, adaptable))
    return out


def valid_targets(chunk) -> list[str]:
    return sorted({n for s in sites(chunk) if s.adaptable for n in s.short_names})


def check_targets(chunk, lcfg: LoRAConfig) -> None:
    cfg = chunk.cfg
    if lcfg.experts and not any(cfg.channel_mixer(i) == "moe" for i in range(cfg.num_layers)):
        raise ConfigError(f"--lora-experts: {cfg.name or cfg.family} has no routed experts (a dense model); drop "
                          f"--lora-experts")
    all_sites = sites(chunk)
    valid = valid_targets(chunk)
    fixed = sorted({n for s in all_sites if not s.adaptable for n in s.short_names})
    refused = [t for t in lcfg.targets if t in fixed] or (fixed if ALL_LINEAR in lcfg.targets else [])
    if refused:
        raise ConfigError(f"lora: {chunk.cfg.family}'s {', '.join(refused)} cannot take adapters (tpzoo's weight "
                          f"holds their rows regrouped, a permutation an adapter cannot follow); name the targets "
                          f"instead{' of ' + ALL_LINEAR if ALL_LINEAR in lcfg.targets else ''}, from: "
                          f"{', '.join(valid)}")
    unknown = [t for t in lcfg.targets if t != ALL_LINEAR and t not in valid]
    if unknown:
        raise ConfigError(f"unknown lora target{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for "
                          f"{chunk.cfg.family}; valid: {', '.join(valid)} (or {ALL_LINEAR})")


def add_lora(chunks, lcfg: LoRAConfig) -> None:
    """Freeze every parameter of the chunks and attach adapters to the targeted layers (on the layers' device;
    built on meta they stay there until `Transformer.materialize`). Adapters are left uninitialized: call
    `init_lora` (or load them)."""
    for chunk in chunks:
        check_targets(chunk, lcfg)
        for p in chunk.parameters():
            p.requires_grad_(False)
        every = ALL_LINEAR in lcfg.targets
        for site in sites(chunk):
            names = [n if (every or n in lcfg.targets) else None for n in site.short_names]
            if all(n is None for n in names):
                continue
            site.layer.lora = LoRA(site.layer, names, lcfg.rank, lcfg.alpha, lcfg.dropout, groups=site.groups)
        if lcfg.experts:
            add_expert_lora(chunk, lcfg.rank, lcfg.alpha)
        chunk.lora_config = lcfg


def init_lora(chunks, seed: int) -> None:
    """Layout-independent adapter init: layer i's adapters from their own seed (A full-size, then sharded)."""
    from .transformer import _seeded  # the same per-module seeding the base weights use

    for chunk in chunks:
        for name, mod in chunk.named_modules():
            if isinstance(mod, (LoRA, ExpertLoRA)):
                layer = block_layer(name, chunk.cfg.num_layers)
                # (the experts' adapters from a stream of their own: not the same draws as the layer's linear ones)
                offset = 2_000_003 if isinstance(mod, ExpertLoRA) else 1_000_003
                with _seeded(seed + offset + layer, chunk.device):
                    mod.init_adapter()
