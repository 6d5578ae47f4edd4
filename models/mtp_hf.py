"""Multi-token prediction's Hugging Face names and config fields (models/mtp.py), in the two layouts the published
checkpoints use, as vLLM's and SGLang's MTP models read them and Megatron-Bridge maps them:

  "deepseek"  DeepSeek-V3 / V3.1 / Moonlight, GLM-4.5: depth j is layer num_hidden_layers + j,
              model.layers.{n+j}.enorm / hnorm / eh_proj / shared_head.norm (tpzoo's final_norm) and the block's
              own names (self_attn.*, mlp.*, input_layernorm, post_attention_layernorm: its kinds'), beside copies of
              the embedding and the head (embed_tokens, shared_head.head), which are never read (the model's own
              are the shared ones) and are written back when the source had them (MTPConfig.hf_copies). The count
              is the config's num_nextn_predict_layers.
  "qwen"      Qwen3-Next, Qwen3.5: mtp.fc (eh_proj), mtp.pre_fc_norm_embedding (enorm), mtp.pre_fc_norm_hidden
              (hnorm), mtp.layers.0.* (the block), mtp.norm (final_norm), at the checkpoint's root (a multimodal
              Qwen3.5's too), zero-centred norms (1 + w) as the model's. One depth: mtp.layers.1.. would share fc and
              the norms, which tpzoo's depths do not. Qwen3.5 counts it in mtp_num_hidden_layers; Qwen3-Next's
              config has no count.

Which depths a checkpoint holds is its tensors' word (`reconcile`): a config saying 1 over a checkpoint without the
weights (a re-upload that dropped them) builds none and exports a count of 0, never a layer of random weights.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tpzoo.errors import ConfigError

from .config import ModelConfig, MTPConfig
from .hf_mapping import same


@dataclass(frozen=True)
class MTPLayout:
    """How a family's checkpoints hold multi-token prediction (Family.hf_mtp): the `style` of names, the config
    field that counts the depths (None: none; `text_config`: inside it), the depths' kinds, the family's published
    loss weight."""
    style: str
    count_field: str | None
    token_mixer: str
    channel_mixer: str
    loss_scale: float = 0.1
    text_config: bool = False

    def settings(self, depths: int) -> MTPConfig | None:
        if not depths:
            return None
        return MTPConfig(depths, self.token_mixer, self.channel_mixer, self.loss_scale)

    def in_directory(self, cfg: ModelConfig, directory) -> ModelConfig:
        """`cfg` (read from the config.json of `directory`) with the depths the weights there hold (their index,
        or the safetensors headers; unchanged where neither is found)."""
        names = weight_names(directory)
        return cfg if names is None else reconcile(cfg, self, names)[0]


INTERNAL = MTPLayout("deepseek", None, None, None)


def export_refusal(cfg: ModelConfig, layout: MTPLayout | None) -> str | None:
    """Why `cfg`'s depths cannot go to a Hugging Face checkpoint of its family (None: they can)."""
    if cfg.mtp is None or layout is not None:
        return None
    return (f"{cfg.family}: its Hugging Face checkpoints hold no multi-token-prediction layers and this model has "
            f"{cfg.mtp_depths} (--mtp-layers): not exported (the tpzoo checkpoint keeps them; a family with an MTP "
            f"layout: deepseek_v3, glm4_moe, qwen3_next, qwen3_5, qwen3_5_moe)")


def mtp_from_hf(layout: MTPLayout, hf: dict) -> MTPConfig | None:
    """The depths the config says (its count field; none without one: the tensors decide, `reconcile`)."""
    text = hf.get("text_config", hf) if layout.text_config else hf
    return layout.settings(int(text.get(layout.count_field) or 0) if layout.count_field else 0)


def mtp_to_hf(layout: MTPLayout, cfg: ModelConfig) -> dict:
    """The count field as the model holds it (0 without depths); {} where the config has none."""
    return {layout.count_field: cfg.mtp_depths} if layout.count_field else {}


def _names(layout: MTPLayout, cfg: ModelConfig, j: int, prefix: str) -> tuple[str, dict[str, str]]:
    """(HF prefix of depth j's block, {tpzoo name under the depth: HF name} of its projection and norms)."""
    if layout.style == "deepseek":
        q = f"{prefix}layers.{cfg.num_layers + j}."
        return q, {"enorm": q + "enorm", "hnorm": q + "hnorm", "eh_proj": q + "eh_proj",
                   "final_norm": q + "shared_head.norm"}
    if layout.style == "qwen":
        return f"mtp.layers.{j}.", {"enorm": "mtp.pre_fc_norm_embedding", "hnorm": "mtp.pre_fc_norm_hidden",
                                    "eh_proj": "mtp.fc", "final_norm": "mtp.norm"}
    raise ConfigError(f"unknown multi-token-prediction layout {layout.style!r}")


def mtp_tensor_maps(cfg: ModelConfig, layout: MTPLayout | None, prefix: str, embed: str, block, norm) -> list:
    """The depths' TensorMaps: `block(i, ours, theirs)` gives a block's (families/hf_common.block_tensor_maps),
    `norm(names)` a norm's ({tpzoo: HF} without .weight)."""
    if layout is None:  # a family whose checkpoints hold none, given depths by --mtp-layers: DeepSeek's names
        layout = INTERNAL  # inside tpzoo (vocab dims, the embedding copy); convert to-hf refuses it (export_refusal)
    if layout.style == "qwen" and cfg.mtp_depths > 1:
        raise ConfigError(f"{cfg.family}: its checkpoints hold one multi-token-prediction layer (mtp.*), the model "
                          f"config has {cfg.mtp_depths}")
    # the copy of the embedding a last pipeline stage holds (models/mtp.py), read from the embedding
    maps = [same("mtp.embed.weight", f"{prefix}{embed}.weight", vocab_dim=0, export=False)]
    head = "embed.weight" if cfg.tie_embeddings else "lm_head.weight"
    for j in range(cfg.mtp_depths):
        ours, layer = f"mtp.layers.{j}.", cfg.num_layers + j
        theirs, own = _names(layout, cfg, j, prefix)
        maps += block(layer, ours + "block.", theirs)
        maps += norm({ours + n: own[n] for n in ("enorm", "hnorm", "final_norm")}, layer=layer)
        maps.append(same(ours + "eh_proj.weight", own["eh_proj"] + ".weight", layer=layer))
        if layout.style == "deepseek" and cfg.mtp.hf_copies:
            maps += [same("embed.weight", theirs + "embed_tokens.weight", vocab_dim=0, mirror=True),
                     same(head, theirs + "shared_head.head.weight", vocab_dim=0, mirror=True)]
    return maps


def reconcile(cfg: ModelConfig, layout: MTPLayout | None, names, prefix: str = "model.") -> tuple[ModelConfig, list]:
    """`cfg` with the depths the checkpoint's tensor `names` hold (their projection's weight says a depth is there),
    and one-line notes where that differs from what the config says."""
    names = set(names)
    if layout is None:
        return cfg, []
    depths = 0
    while depths < 64 and _names(layout, cfg, depths, prefix)[1]["eh_proj"] + ".weight" in names:
        depths += 1
        if layout.style == "qwen":
            break
    if layout.style == "deepseek" and depths:
        copies = f"{prefix}layers.{cfg.num_layers}.embed_tokens.weight" in names
    else:
        copies = True
    said = cfg.mtp_depths
    mtp = layout.settings(depths)
    if mtp is not None and cfg.mtp is not None:  # the config's own settings, the count the tensors'
        mtp = replace(cfg.mtp, num_layers=depths)
    if mtp is not None:
        mtp = replace(mtp, hf_copies=copies)
    notes = []
    if said and not depths:
        notes.append(f"{cfg.family}: the config counts {said} multi-token-prediction layer(s) "
                     f"({layout.count_field}), but the checkpoint holds none: none built, and an export writes 0")
    elif depths != said and said:
        notes.append(f"{cfg.family}: the config counts {said} multi-token-prediction layer(s), the checkpoint holds "
                     f"{depths}: those are imported")
    return cfg.replace(mtp=mtp), notes


def weight_names(directory) -> set | None:
    """The tensor names of a Hugging Face directory's weights (model.safetensors.index.json, or the headers of its
    *.safetensors files), None without either."""
    import json
    from pathlib import Path

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text()).get("weight_map", {}))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    names = set()
    for f in files:
        with safe_open(str(f), "pt") as st:
            names.update(st.keys())
    return names
