"""Training configuration: documented dataclasses, loaded from TOML, every field overridable on the command line.

Precedence (later wins): the dataclass defaults < the command's defaults (`finetune` changes a few) < a TOML file
< `--flag value` on the command line. Field names are unique across sections, so a TOML file may use the
sections below or put any key at the top level, and each field is the flag `--field-name`:

    [parallel]                       # == tp = 2 at the top level == --tp 2
    tp = 2

The help text and the valid range of every field live in its metadata (`ge`/`gt`/`le`/`lt`, `choices`), so
`--help`, docs/training.md's reference table (`describe_config()`), the checks and the code cannot disagree.
Every value is checked when it is set (type, range, choices; tpzoo.train.config_values), naming the field, the
value and where it came from (`run.toml:7`, `--lr`); `TrainConfig.validate()` checks the combinations of fields;
tpzoo.train.preflight checks the config against the model and the files before any rank starts.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from tpzoo.errors import ConfigError

from .config_values import check_table, check_value, parse_link, range_text, read_toml, suggest

# tpzoo.pipeline.SCHEDULES' names, spelled out so that reading a config does not import the pipeline (a test
# keeps the two equal).
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb")


def _f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class RunSection:
    task: str = _f("pretrain", "'pretrain' (packed text corpus) or 'sft' (JSONL prompt/response or chat messages, "
                               "loss only on response tokens)", choices=("pretrain", "sft"))
    steps: int = _f(150, "total optimizer steps of the run (a resumed run continues to this total; it also sets "
                         "the LR schedule, so a resumed run follows the same curve)", ge=1)
    seed: int = _f(1234, "seed for the weights (layout independent), the data order and sampling", ge=0)
    max_skips: int = _f(5, "stop after this many consecutive steps skipped for a NaN/inf loss or grad norm "
                           "(the last good checkpoint is kept)", ge=1)
    inject_nan_steps: list = _f([], "testing aid: make the loss scale NaN at these steps (1-based)", type=int,
                                ge=1)
    inject_oom_steps: list = _f([], "testing aid: raise a CUDA out-of-memory error at these steps (1-based)",
                                type=int, ge=1)


@dataclass
class ModelSection:
    model: str = _f("tiny-gpt", "registered config name (tiny-gpt, tiny-llama, nano-gpt, llama-3-8b, ...); "
                                "ignored when --base gives the weights")
    vocab_size: int = _f(0, "vocabulary of a model trained from scratch; 0 = the tokenizer's vocab size", ge=0)
    base: str = _f("", "initial weights: a tpzoo checkpoint or a Hugging Face model directory (fine-tuning, "
                       "continued pretraining); the model config and, unless --tokenizer, the tokenizer come "
                       "from it")
    dtype: str = _f("fp32", "'fp32', 'bf16' or 'fp16' (16-bit weights and activations; fp32 master weights, main "
                            "gradients and optimizer state; fp16 adds dynamic loss scaling)",
                    choices=("fp32", "bf16", "fp16"))
    fp8: str = _f("none", "FP8 matmuls of the attention and MLP projections (LoRA's frozen base included; the LM "
                          "head, embeddings and experts stay in --dtype): 'tensorwise' (one scale per tensor, e4m3 "
                          "forward, e5m2 gradients) or 'rowwise' (per-row scales, e4m3); dynamic scales agreeing "
                          "across TP ranks; torch._scaled_mm on CUDA (Hopper), emulated exactly elsewhere; weights, "
                          "master weights, gradients and checkpoints unchanged (docs/training.md)",
                  choices=("none", "tensorwise", "rowwise"))
    mtp_layers: int = _f(0, "multi-token-prediction depths (DeepSeek-V3's MTP, docs/models.md) to add to a model "
                            "trained from scratch (--model); 0 = the model's own (a checkpoint or Hugging Face "
                            "directory keeps the depths it holds)", ge=0)


@dataclass
class ParallelSection:
    tp: int = _f(2, "tensor-parallel size (divides the heads; kv heads divide by it or it by them)", ge=1)
    pp: int = _f(1, "pipeline-parallel size (pp * virtual_stages <= layers)", ge=1)
    dp: int = _f(0, "data-parallel size; 0 = world size / (tp * cp * pp) under torchrun, 1 when self-spawning", ge=0)
    cp: int = _f(1, "context-parallel size: each rank holds 2 of the 2*cp load-balanced chunks of every sequence "
                    "(padded to whole chunks), attention runs over the cp group", ge=1)
    cp_mode: str = _f("ring", "context-parallel attention: 'ring' (K/V passed around the cp ring, overlapped) or "
                              "'a2a' (all-to-all over heads, Ulysses; heads per TP rank divisible by cp)",
                      choices=("ring", "a2a"))
    ep: int = _f(1, "expert-parallel size of a mixture-of-experts model: the experts split over ep of the dp "
                    "replicas (ep divides dp and the experts; docs/moe.md)", ge=1)
    sequence_parallel: bool = _f(False, "shard activations along the sequence between TP regions (seq_len "
                                        "divisible by tp)")
    schedule: str = _f("1f1b", "pipeline schedule (tpzoo.pipeline.SCHEDULES; only interleaved runs "
                               "virtual_stages > 1)", choices=SCHEDULE_NAMES)
    pp_boundaries: list = _f([], "pipeline split points instead of the split balanced by parameters: the first "
                                 "layer of every model stage, then the layer count (pp * virtual_stages + 1 "
                                 "numbers, e.g. --pp-boundaries 0 3 8 or 0,3,8 for 8 layers at pp 2; `tpzoo plan` "
                                 "prints a time-balanced split for models whose layers differ); uneven stages are "
                                 "fine, empty ones are refused", type=int, ge=0)
    virtual_stages: int = _f(1, "model chunks per pipeline rank (interleaved schedule)", ge=1)
    recompute: str = _f("none", "activation recomputation: none | selective | full",
                        choices=("none", "selective", "full"))
    fused_linear_cross_entropy: bool = _f(True, "compute the LM head's matmul and the loss together in chunks of "
                                                "tokens, never the logits of all the tokens (same loss and "
                                                "gradients; false: logits, then the vocab-parallel cross-entropy)")
    zero: int = _f(0, "ZeRO level over dp: 0 replicated optimizer; 1 optimizer state (fp32 master, moments) "
                      "sharded, gradients reduce-scattered, updated weights all-gathered; 2 also no full-size fp32 "
                      "gradient buffer (reduce-scattered as buckets fill, every micro-batch); 3 also the weights "
                      "sharded, each layer all-gathered when used (next one prefetched) and freed after",
                   ge=0, le=3)
    zero1: bool = _f(False, "alias of --zero 1")
    zero3_gather_per_step: bool = _f(False, "ZeRO-3: keep each layer gathered from its first use to the end of the "
                                            "step (one all-gather per step; the stage's whole weights held) "
                                            "instead of gathering it for every micro-batch's forward and backward")
    overlap_grad_reduce: bool = _f(True, "start each gradient bucket's data-parallel reduction during the "
                                         "backward passes, as soon as its gradients are final")
    grad_bucket_elems: int = _f(1 << 24, "elements per data-parallel gradient bucket (one collective each)",
                                ge=1)
    grad_accumulation_fusion: bool = _f(True, "the linear layers accumulate their weight gradients straight into "
                                              "the fp32 main gradients in the backward matmul (no 16-bit .grad, no "
                                              "separate add; Megatron's gradient_accumulation_fusion)")
    compile: bool = _f(False, "regional torch.compile: each transformer block compiled on its own (graph breaks "
                              "only at the TP collectives, FP8 projections and MoE's expert dispatch; the first step "
                              "compiles, reported once; not with --zero 3; docs/training.md)")
    device: str = _f("auto", "where each rank computes: auto (cuda:LOCAL_RANK when CUDA is available, else cpu), "
                             "cpu, cuda or cuda:N", nonempty=True)
    dist_timeout: float = _f(600.0, "seconds a rank may wait on another (a collective, a stalled or dead rank) before "
                                    "the job fails naming the rank", gt=0)


@dataclass
class ReplicaSection:
    replicas: int = _f(1, "split the data-parallel ranks into this many replicas of dp/replicas consecutive dp ranks "
                          "(whole model copies: nodes, clusters) joined by a slow link; inside a replica everything "
                          "works as without (docs/training.md, 'Training across slow links')", ge=1)
    sync_every: int = _f(1, "1: every step's gradients summed across the replicas hierarchically (reduce-scatter "
                            "inside, all-reduce of each shard across, all-gather inside); H > 1: DiLoCo, each "
                            "replica takes H AdamW steps alone, then their parameter changes are averaged and "
                            "applied by the outer optimizer", ge=1)
    sync_fragments: int = _f(1, "Streaming DiLoCo: the layers in F fragments (strided: layer i in fragment i % F), "
                                "fragment f synced at its own offset of the H steps (at most the layers, at most "
                                "sync_every)", ge=1)
    sync_overlap: int = _f(0, "Streaming DiLoCo: start each fragment's exchange this many inner steps before it is "
                              "applied, overlapped with them (less than sync_every / sync_fragments)", ge=0)
    sync_dtype: str = _f("fp32", "dtype of the outer gradients sent across replicas (summed in fp32): fp32, bf16, "
                                 "or fp8 (e4m3 with an fp32 scale per 128 values)", choices=("fp32", "bf16", "fp8"))
    outer_lr: float = _f(0.7, "DiLoCo's outer learning rate (Nesterov SGD on the averaged parameter change; the "
                              "paper's 0.7; short runs of small models want less, docs/training.md)", ge=0)
    outer_momentum: float = _f(0.9, "DiLoCo's outer Nesterov momentum (the paper's 0.9)", ge=0, lt=1)
    emulate_link: str = _f("", "emulate a slow link between the replicas: GBPS[:LATENCY_MS] (gigabits per second, "
                               "milliseconds); every collective across replicas then lasts at least its bytes / "
                               "bandwidth + latency ('' = TPZOO_EMULATE_LINK, else none)")


@dataclass
class DataSection:
    data: list = _f([], "pretrain: text/.jsonl/.parquet files, directories, a token store or a Megatron dataset "
                        "prefix (PREFIX.bin + PREFIX.idx), concatenated; or a weighted mixture of them as WEIGHT PATH "
                        "pairs (Megatron's syntax: 0.7 web/ 0.3 code/; docs/data.md); default: the Python standard "
                        "library's .py files; sft: one JSONL file", type=str, nonempty=True)
    mix: dict = _f({}, "pretrain: a weighted mixture as a table PATH = WEIGHT ([data.mix] in a config file; on the "
                       "command line PATH=WEIGHT ...); the same as --data WEIGHT PATH pairs, not given with --data")
    tokenizer: str = _f("", "'byte', or a Hugging Face tokenizer / checkpoint directory; '' = the base's "
                            "tokenizer, else 'byte'")
    seq_len: int = _f(256, "tokens per training sequence", ge=1)
    global_batch_size: int = _f(16, "sequences per optimizer step, over all data-parallel ranks (a multiple of "
                                    "micro_batch_size * dp); DPO: preference pairs (one pair per sequence)", ge=1)
    micro_batch_size: int = _f(8, "sequences per forward/backward (DPO: pairs); gradient accumulation runs "
                                  "global / (micro * dp) micro-batches per step", ge=1)
    data_cache: str = _f("runs/data", "where corpora are tokenized once into token stores (reused by later runs)",
                         nonempty=True)
    text_field: str = _f("text", "JSONL field / Parquet column with the text (pretrain)", nonempty=True)
    eval_fraction: float = _f(0.005, "held-out share: pretrain = the last windows of the corpus, sft = a seeded "
                                     "subset of the records", ge=0, lt=1)
    packing: bool = _f(True, "sft: pack whole examples into full sequences, attention within each example and "
                             "positions restarting (else one padded example per sequence; the same loss either way)")
    document_masking: bool = _f(False, "pretrain: attention stays within each document of a packed sequence and "
                                       "positions restart at each (as if every document trained alone)")
    template: str = _f("auto", "sft rendering: auto (the tokenizer's chat template, else fallback) | fallback "
                               "| raw", choices=("auto", "fallback", "raw"))
    prefetch: int = _f(2, "batches prepared ahead on a background thread (0 = none)", ge=0)


@dataclass
class LoraSection:
    lora_rank: int = _f(0, "LoRA: train low-rank adapters of this rank on a frozen --base (0 = train every "
                           "weight); checkpoints hold only the adapters", ge=0)
    lora_alpha: float = _f(16.0, "LoRA scaling numerator: adapters add (alpha / rank) * x A^T B^T", gt=0)
    lora_dropout: float = _f(0.0, "LoRA dropout on the adapters' input (PEFT's lora_dropout)", ge=0, lt=1)
    lora_targets: list = _f(["all-linear"], "LoRA targets: Hugging Face projection names (q_proj,k_proj,v_proj,"
                                            "o_proj,gate_proj,up_proj,down_proj for LLaMA-style models) or "
                                            "all-linear", type=str, nonempty=True)
    lora_experts: bool = _f(False, "LoRA: also one adapter of --lora-rank per routed expert on each of its weights "
                                   "(gate|up and down) of a mixture of experts, in PEFT's target_parameters form; no "
                                   "--lora-dropout")
    lora_from: str = _f("", "start the adapters from this PEFT adapter directory (its rank, alpha, dropout and "
                            "targets replace the --lora-* values); any tp/pp/ep")


@dataclass
class PostSection:
    objective: str = _f("lm", "what the fine-tune optimizes: 'lm' (next-token loss on the response tokens), 'dpo' "
                              "(preference pairs: --data JSONL of prompt/chosen/rejected; tpzoo.post.dpo) or 'distill' "
                              "(a --teacher's top-K log-probabilities; tpzoo.post.distill)",
                        choices=("lm", "dpo", "distill"))
    dpo_beta: float = _f(0.1, "DPO: beta, the strength of the reference's pull (the reward is beta x the log-ratio)",
                         gt=0)
    dpo_loss: str = _f("sigmoid", "DPO loss: 'sigmoid' (the paper's) or 'ipo' (TRL's IPO: log-ratios averaged over "
                                  "the response tokens)", choices=("sigmoid", "ipo"))
    dpo_label_smoothing: float = _f(0.0, "DPO: conservative DPO's label smoothing eps (the sigmoid loss, Mitchell's "
                                         "formula: -(1-eps) log sig(z) - eps log sig(-z))", ge=0, lt=0.5)
    dpo_precompute_ref: bool = _f(False, "DPO: compute every pair's reference log-probabilities once, before the "
                                         "first step (no reference model held; kept in the checkpoints)")
    teacher: str = _f("", "distill: the teacher, a tpzoo checkpoint or Hugging Face directory loaded at this run's "
                          "layout, or a cache written by `tpzoo distill-cache`")
    distill_topk: int = _f(8, "distill: the teacher's most likely tokens per position the KL runs over", ge=1)
    distill_temperature: float = _f(1.0, "distill: softmax temperature T of teacher and student (the KL term is "
                                         "scaled by T^2)", gt=0)
    distill_alpha: float = _f(0.5, "distill: weight A of the KL term; 1 - A weighs the next-token loss", ge=0, le=1)


@dataclass
class OptimSection:
    lr: float = _f(3e-3, "peak learning rate (0 = the weights never change, e.g. to measure a starting loss)",
                   ge=0)
    min_lr: float = _f(None, "learning rate at the end of the cosine decay (at most lr; unset, it is lr / 10 and "
                             "follows --lr, so --lr 0 runs at 0 throughout)", ge=0)
    warmup_steps: int = _f(15, "linear warmup steps", ge=0)
    weight_decay: float = _f(0.1, "decoupled weight decay (AdamW: matrices and embeddings, not norms or biases; "
                                  "Muon: its matrices)", ge=0)
    beta1: float = _f(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = _f(0.95, "AdamW beta2", ge=0, lt=1)
    eps: float = _f(1e-8, "AdamW epsilon", gt=0)
    clip_grad: float = _f(1.0, "clip the global gradient norm to this (0 = no clipping)", ge=0)
    label_smoothing: float = _f(0.0, "cross-entropy label smoothing", ge=0, lt=1)
    router_bias_update_rate: float = _f(None, "mixtures of experts with the sigmoid router (DeepSeek-V3, GLM-4.5): "
                                              "auxiliary-loss-free balancing, each layer's selection bias moves by "
                                              "this times sign(mean load - expert load) after every optimizer "
                                              "step, the loads of the whole step on every rank (0 freezes it; "
                                              "unset, 1e-3, and 0 for LoRA, whose base stays frozen, selection "
                                              "biases included)", ge=0)
    router_aux_loss_coef: float = _f(0.0, "mixtures of experts with the sigmoid router: weight of Megatron-Core's "
                                          "sequence-wise auxiliary loss (0 = off, as HF's configs; the softmax "
                                          "routers' load-balancing loss keeps the model config's)", ge=0)
    dsa_indexer_loss_scale: float = _f(0.0, "DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): train the lightning "
                                            "indexers with the KL divergence from the main attention's "
                                            "distribution to theirs, each layer's mean over the queries, summed "
                                            "over the layers, times this (logged as dsa_indexer_loss); 0 keeps "
                                            "the indexers frozen, as the checkpoint has them", ge=0)
    dsa_indexer_sparse_loss: bool = _f(False, "DeepSeek Sparse Attention: the indexer's KL over each query's "
                                              "selected keys only (DeepSeek-V3.2's sparse stage), not every key it "
                                              "sees")
    mtp_loss_scale: float = _f(-1.0, "weight S of multi-token prediction's mean loss over its depths in the "
                                      "training loss (LM + S x MTP); negative = the model's, its family's "
                                      "published default (DeepSeek-V3 0.1, GLM-4.5 0.3, else 0.1); 0 = the "
                                      "depths kept, untrained", ge=-1)
    z_loss: float = _f(0.0, "z-loss weight: adds z_loss * logsumexp(logits)^2 to each trained token's loss (PaLM "
                            "used 1e-4, OLMo 2's pretraining 1e-5; 0 = off; the eval loss never has it)", ge=0)
    optimizer: str = _f("adamw", "'adamw', or 'muon': Muon (torch.optim.Muon's rule, lr x 0.2 x sqrt(max(rows, "
                                 "cols)), so --lr and --weight-decay carry over) for the hidden layers' matrices, "
                                 "each projection and expert orthogonalized whole, AdamW for the rest "
                                 "(docs/training.md)", choices=("adamw", "muon"))
    muon_momentum: float = _f(0.95, "Muon's (Nesterov) momentum", ge=0, lt=1)
    muon_ns_steps: int = _f(5, "Muon's Newton-Schulz iterations", ge=1, le=99)
    muon_ns_dtype: str = _f("bf16", "dtype of Muon's Newton-Schulz iteration and of the matrices' exchange: 'bf16' "
                                    "(torch.optim.Muon's) or 'fp32' (Megatron-Core's default; faster on CPUs "
                                    "without bf16 matmul units, twice the bytes)", choices=("bf16", "fp32"))
    qk_clip: float = _f(0.0, "MuonClip (Kimi K2): after each step, scale the q and k projection rows of every "
                             "attention head whose largest pre-softmax logit of the step exceeded this by "
                             "sqrt(qk_clip / logit) (0 = off; needs --optimizer muon)", ge=0)
    log_max_attn_logit: bool = _f(False, "log the step's largest pre-softmax attention logit as max_attn_logit "
                                         "(always on with --qk-clip; costs an extra q k^T per attention layer)")


@dataclass
class CheckpointSection:
    save: str = _f("runs/pretrain", "checkpoint directory (step_NNNNNNNN subdirectories); '' = do not save")
    save_every: int = _f(0, "save every N steps (0 = only at the end)", ge=0)
    keep_last: int = _f(3, "keep the newest K checkpoints (0 = keep all)", ge=0)
    overwrite: bool = _f(False, "start a fresh run in a --save directory that already holds a run (its checkpoints "
                                "and metrics are moved aside, see docs/reliability.md)")
    resume: str = _f("", "'' = start fresh; 'auto' (also 'latest', or the bare flag) = the newest intact checkpoint "
                         "under --save (damaged ones are skipped, saying why); or a checkpoint directory",
                     nargs="?", const="auto")


@dataclass
class LogSection:
    log_dir: str = _f("", "write metrics.jsonl (and TensorBoard events if installed) here; '' = --save")
    log_interval: int = _f(10, "print a metrics line every N steps", ge=1)
    eval_every: int = _f(0, "evaluate on the held-out split every N steps (0 = only at the end)", ge=0)
    eval_batches: int = _f(4, "one evaluation takes the held-out split's first eval_batches x micro_batch_size "
                              "sequences, the same at every layout (split over the dp ranks)", ge=1)
    progress: bool = _f(True, "progress bar on rank 0 (when stderr is a terminal)")
    quiet: bool = _f(False, "print nothing (metrics.jsonl is still written)")
    sample_prompt: str = _f("def ", "prompt of the sample printed at the end ('' = no sample)")
    sample_tokens: int = _f(160, "tokens to generate for the sample", ge=0)
    temperature: float = _f(0.8, "sampling temperature of the sample (0 = greedy)", ge=0)


# Fields whose unset default (None) is computed from other fields, so that it follows them: the value a run uses
# (cfg.min_lr, to_dict, --print-config) is always a number. lr / 10 is rounded to 15 significant digits, so that
# 3e-3 gives 3e-4 (the number written in a config), not 3.0000000000000003e-4. router_bias_update_rate: 0 for LoRA,
# whose base stays frozen, the routers' selection biases included (a LoRA checkpoint and a PEFT adapter hold only the
# adapters); the MoE kind's run_settings (models/kinds/moe.py) also knows a resumed LoRA run given without --lora-rank.
ROUTER_BIAS_UPDATE_RATE = 1e-3  # DeepSeek-V3's gamma
MTP_ZERO3 = ("--zero 3 with multi-token prediction: its depths use the embedding and the head a second time in a "
             "forward, which ZeRO-3's per-layer gathers do not follow; use --zero 2 (or --mtp-loss-scale 0)")
FOLLOWS: dict[str, Callable[["TrainConfig"], Any]] = {
    "min_lr": lambda cfg: float(f"{cfg.lr / 10:.15g}"),
    "router_bias_update_rate": lambda cfg: 0.0 if (cfg.lora_rank or cfg.lora_from) else ROUTER_BIAS_UPDATE_RATE}

SECTIONS = {"run": RunSection, "model": ModelSection, "parallel": ParallelSection, "replicas": ReplicaSection,
            "data": DataSection,
            "lora": LoraSection, "post": PostSection, "optim": OptimSection, "checkpoint": CheckpointSection,
            "log": LogSection}

# Where a value came from, for error messages: one text for every key, or a function of the key.
Where = str | Callable[[str], str] | None


class TrainConfig:
    """Every field of the sections above, read and written flat (`cfg.lr`, `cfg.set("lr", 1e-3)`); the
    sections only organize the TOML file and the docs. `cfg.section("optim")` is the OptimSection."""

    def __init__(self):
        object.__setattr__(self, "_sections", {name: cls() for name, cls in SECTIONS.items()})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in _FIELD_SECTION:  # also keeps pickle's probes away
            raise AttributeError(f"TrainConfig has no field {name!r}")
        value = getattr(self._sections[_FIELD_SECTION[name]], name)
        return FOLLOWS[name](self) if value is None and name in FOLLOWS else value

    def __setattr__(self, name: str, value: Any) -> None:
        self.set(name, value)

    def __eq__(self, other) -> bool:
        return isinstance(other, TrainConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"TrainConfig({self.to_dict()})"

    def __getstate__(self) -> dict:
        """to_dict without the FOLLOWS fields left unset: on the other side (a rank) they still follow."""
        out = self.to_dict()
        for name in FOLLOWS:
            if not self.is_set(name):
                del out[_FIELD_SECTION[name]][name]
        return out

    def __setstate__(self, state: dict) -> None:
        object.__setattr__(self, "_sections", {name: cls() for name, cls in SECTIONS.items()})
        self.update(_flatten(state, "state"))

    def section(self, name: str):
        return self._sections[name]

    def is_set(self, name: str) -> bool:
        """Whether field `name` was given a value (a FOLLOWS field left unset follows the others)."""
        return getattr(self._sections[_FIELD_SECTION[name]], name) is not None

    def set(self, name: str, value: Any, where: str = "") -> None:
        """Set one field, checked (type, range, choices); `where` (a file:line, a flag) prefixes any error."""
        prefix = f"{where}: " if where else ""
        if name not in _FIELD_SECTION:
            raise ConfigError(f"{prefix}unknown config key {name!r}{_did_you_mean(name)}")
        try:
            value = _coerce(name, value)
        except ConfigError as e:
            raise ConfigError(prefix + str(e)) from None
        setattr(self._sections[_FIELD_SECTION[name]], name, value)

    def update(self, values: dict, where: Where = None) -> "TrainConfig":
        for k, v in values.items():
            key = k.replace("-", "_")
            self.set(key, v, where(key) if callable(where) else (where or ""))
        return self

    def validate(self, world_size: int | None = None) -> "TrainConfig":
        """Check the combinations of fields that need no model or file (each field alone was checked when set).
        world_size: the job's number of ranks (tpzoo.parallel.state.job_world_size; None: the ranks the command
        will spawn)."""
        if self.min_lr > self.lr:
            raise ConfigError(f"min_lr {self.min_lr:g} is above lr {self.lr:g}: the cosine decay would raise the "
                              f"learning rate (set --min-lr at most --lr)")
        dp = self.data_parallel_size(world_size)
        self._validate_sync()
        per_step = self.micro_batch_size * dp
        if self.global_batch_size % per_step:
            raise ConfigError(f"global_batch_size {self.global_batch_size} is not a multiple of micro_batch_size "
                              f"{self.micro_batch_size} x dp {dp} = {per_step}")
        n_micro = self.global_batch_size // per_step
        if self.cp > 1 and self.seq_len < 2 * self.cp:
            raise ConfigError(f"cp={self.cp} cuts every sequence into 2*cp = {2 * self.cp} chunks, more than seq_len "
                              f"{self.seq_len} tokens")
        if self.sequence_parallel and self.tp > 1 and self.cp == 1 and self.seq_len % self.tp:  # cp pads
            raise ConfigError(f"sequence_parallel: seq_len {self.seq_len} is not divisible by tp={self.tp}")
        if self.pp > 1 and self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ConfigError(f"virtual_stages={self.virtual_stages} needs schedule = 'interleaved' (schedule "
                              f"{self.schedule!r} runs one model chunk per pipeline rank)")
        if self.pp_boundaries and len(self.pp_boundaries) != self.pp * self.virtual_stages + 1:
            raise ConfigError(f"pp_boundaries {self.pp_boundaries} needs pp * virtual_stages + 1 = "
                              f"{self.pp * self.virtual_stages + 1} entries (the first layer of each model stage, "
                              "then the number of layers)")
        if self.pp > 1 and self.schedule == "interleaved" and n_micro % self.pp:
            raise ConfigError(f"the interleaved schedule needs the micro-batches per step (global_batch_size / "
                              f"(micro_batch_size * dp) = {n_micro}) to be a multiple of pp={self.pp}")
        if self.lora_experts and not (self.lora_rank or self.lora_from or self.resume):
            raise ConfigError("--lora-experts adapts the routed experts in a LoRA run: give --lora-rank R (or "
                              "--lora-from a PEFT adapter)")
        if (self.lora_rank or self.lora_from) and not (self.base or self.resume):
            raise ConfigError("LoRA (--lora-rank / --lora-from) trains adapters on a frozen model: give it with "
                              "--base (or --resume a LoRA run)")
        if self.zero1 and self.zero not in (0, 1):
            raise ConfigError(f"zero1 = true is --zero 1, but zero = {self.zero} is also set: keep one of them")
        if self.zero_level == 3 and (self.lora_rank or self.lora_from):
            raise ConfigError("--zero 3 with LoRA: the frozen base is not sharded (ZeRO-3 shards trained weights "
                              "only); use --zero 2")
        if self.zero_level == 3 and self.ep > 1:
            raise ConfigError(f"--zero 3 with ep={self.ep}: sharding the expert weights over their own group is not "
                              f"implemented; use --zero 2 (or ep=1)")
        if self.mtp_layers and self.zero_level == 3:
            raise ConfigError(MTP_ZERO3)
        if self.compile and self.zero_level == 3:
            raise ConfigError("--compile with --zero 3: the per-layer gathers (hooks on the compiled blocks) are not "
                              "composed with compilation; use --zero 2")
        if self.qk_clip > 0 and self.optimizer != "muon":
            raise ConfigError(f"--qk-clip {self.qk_clip:g} is MuonClip: it needs --optimizer muon (to watch the "
                              f"logits with AdamW: --log-max-attn-logit)")
        if self.optimizer == "muon" and self.replicas > 1:
            raise ConfigError(f"--optimizer muon with --replicas {self.replicas}: not implemented yet (DiLoCo's "
                              f"replicas and their checkpoints keep AdamW's state); use --optimizer adamw")
        if self.qk_clip > 0 and (self.lora_rank or self.lora_from):
            raise ConfigError(f"--qk-clip {self.qk_clip:g} with LoRA: the q and k projections are frozen")
        if self.zero3_gather_per_step and self.zero_level != 3:
            raise ConfigError(f"zero3_gather_per_step needs --zero 3 (zero = {self.zero_level})")
        if self.task == "sft" and self.document_masking:
            raise ConfigError("document_masking is for pretraining: SFT packing always keeps attention within "
                              "each example (--no-packing pads one per sequence)")
        if self.task == "pretrain":
            from tpzoo.data.mixture import parse_mixture

            parse_mixture(self.data, self.mix)  # weights and paths pair, weights are positive numbers
        elif self.mix:
            raise ConfigError("a [data] mix table is for pretraining; fine-tuning takes one JSONL file (--data)")
        self._validate_objective()
        if self.task == "sft" and len(self.data) != 1:
            raise ConfigError(f"task 'sft' needs exactly one SFT JSONL file (--data PATH.jsonl), got "
                              f"{len(self.data)}: {self.data}")
        return self

    def _validate_objective(self) -> None:
        """--objective against the task and the objective's own settings (tpzoo.post)."""
        if self.objective != "lm" and self.task != "sft":
            raise ConfigError(f"--objective {self.objective} fine-tunes: use `tpzoo finetune` (task 'sft')")
        if self.objective == "distill" and not self.teacher:
            raise ConfigError("--objective distill needs --teacher (a checkpoint, a Hugging Face directory or a "
                              "`tpzoo distill-cache` directory)")
        if self.teacher and self.objective != "distill":
            raise ConfigError(f"--teacher is for --objective distill (the objective is {self.objective!r})")
        if self.dpo_precompute_ref and self.objective != "dpo":
            raise ConfigError(f"--dpo-precompute-ref is for --objective dpo (the objective is {self.objective!r})")
        if self.dpo_loss == "ipo" and self.dpo_label_smoothing:
            raise ConfigError("--dpo-label-smoothing is conservative DPO, a form of the sigmoid loss, not of ipo")

    def _validate_sync(self) -> None:
        """DiLoCo's schedule: fragments fit the interval, the overlap fits a fragment's share of it."""
        h, f, t = self.sync_every, self.sync_fragments, self.sync_overlap
        if f > h:
            raise ConfigError(f"sync_fragments={f} is more than sync_every={h}: each fragment is synced at its own "
                              f"step of the {h}-step interval")
        if t and t >= h // f:
            raise ConfigError(f"sync_overlap={t} must be less than sync_every / sync_fragments = {h}/{f} (an "
                              f"exchange must be applied before the next fragment's starts)")
        if h == 1 and self.sync_dtype != "fp32":
            raise ConfigError(f"sync_dtype {self.sync_dtype!r} is for DiLoCo's outer gradients (sync_every > 1); "
                              f"synchronous training sums fp32 gradients")
        if h > 1 and self.dtype == "fp16":
            raise ConfigError("--dtype fp16 with sync_every > 1: each replica would scale its loss on its own; use "
                              "bf16")
        parse_link(self.emulate_link)

    def data_parallel_size(self, world_size: int | None = None) -> int:
        """dp of this config on `world_size` ranks (None: the ranks the command spawns itself, spawn_world_size),
        decided by the function init_parallel applies to the same numbers (tpzoo.parallel.dims.check_layout: the
        world size divisible by tp*cp*pp, an explicit dp matching it, ep dividing dp*cp, replicas dividing dp), so
        the preflight and the ranks cannot disagree on it."""
        from tpzoo.parallel.dims import check_layout

        world = self.spawn_world_size() if world_size is None else world_size
        return check_layout(world, tp=self.tp, pp=self.pp, cp=self.cp, dp=self.dp or None, ep=self.ep,
                            replicas=self.replicas)

    def spawn_world_size(self) -> int:
        """The ranks a command started without torchrun spawns: tp*cp*pp*dp (dp 0: one replica)."""
        return self.tp * self.cp * self.pp * (self.dp or 1)

    @property
    def zero_level(self) -> int:
        """The ZeRO level asked for, by --zero or its alias --zero1."""
        return max(self.zero, 1 if self.zero1 else 0)

    def to_dict(self) -> dict:
        """Every field's value, the ones that follow others (FOLLOWS) included as the numbers they are now."""
        out = {name: dataclasses.asdict(sec) for name, sec in self._sections.items()}
        for name in FOLLOWS:
            out[_FIELD_SECTION[name]][name] = getattr(self, name)
        return out

    def to_toml(self) -> str:
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
            lines.append("")
        return "\n".join(lines)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return cls().update(_flatten(d, "config"))


_FIELD_SECTION: dict[str, str] = {}
_FIELDS: dict[str, dataclasses.Field] = {}
for _section, _cls in SECTIONS.items():
    for _fld in dataclasses.fields(_cls):
        assert _fld.name not in _FIELD_SECTION, f"config field {_fld.name} is defined twice"
        _FIELD_SECTION[_fld.name], _FIELDS[_fld.name] = _section, _fld


def _field_type(f: dataclasses.Field) -> type:
    t = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool, "str": str,
                                                  "list": list, "dict": dict}[str(f.type)]
    return t


def _did_you_mean(name: str, section: str | None = None) -> str:
    """' (did you mean 'lr'?)', naming the section when it is not the one the key was written in."""
    best = suggest(name, _FIELD_SECTION)
    if best is None:
        return "; `--help` or docs/training.md lists the fields"
    where = f" in [{_FIELD_SECTION[best]}]" if section and _FIELD_SECTION[best] != section else ""
    return f" (did you mean {best!r}{where}?)"


def _coerce(name: str, value: Any) -> Any:
    f = _FIELDS[name]
    t = _field_type(f)
    if t is list:
        items = value if isinstance(value, (list, tuple)) else [value]
        if f.metadata.get("type") is int:  # 0,3,8 as well as 0 3 8
            items = [x for v in items for x in (v.split(",") if isinstance(v, str) else [v])]
        return [check_value(name, v, f.metadata.get("type", str), f.metadata) for v in items]
    if t is dict:
        return check_table(name, value)
    return check_value(name, value, t, f.metadata)


def _flatten(d: dict, where: str, lines: dict | None = None) -> dict:
    """{"optim": {"lr": 1}, "seed": 3} -> {"lr": 1, "seed": 3}: sections are optional in TOML. A key in the wrong
    section, or an unknown section, is an error naming it (and its line, given the TOML's `lines`)."""
    lines = lines or {}

    def at(section, key) -> str:
        line = lines.get((section, key))
        return f"{where}:{line}" if line else where

    flat = {}
    for k, v in d.items():
        if k in SECTIONS and isinstance(v, dict):
            for kk, vv in v.items():
                if _FIELD_SECTION.get(kk) != k:
                    hint = (f" (it belongs in [{_FIELD_SECTION[kk]}])" if kk in _FIELD_SECTION
                            else _did_you_mean(kk, k))
                    raise ConfigError(f"{at(k, kk)}: [{k}] has no key {kk!r}{hint}")
                flat[kk] = vv
        elif isinstance(v, dict) and (k not in _FIELD_SECTION or _field_type(_FIELDS[k]) is not dict):
            # a table: a section (a field that takes a table, [mix], aside), even when a field has its name
            best = suggest(k, SECTIONS)
            hint = f" (did you mean [{best}]?)" if best else f"; sections: {', '.join(SECTIONS)}"
            raise ConfigError(f"{at(None, k)}: unknown section [{k}]{hint}")
        else:
            flat[k] = v
    return flat


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def load_config(path: str | None = None, overrides: dict | None = None, defaults: dict | None = None,
                override_source: Where = None) -> TrainConfig:
    """Defaults, then the command's `defaults`, then the TOML file at `path`, then `overrides` (flat keys).
    An error names where the bad value came from: the file and line, or `override_source` (e.g. the flag)."""
    cfg = TrainConfig().update(defaults or {})
    if path:
        data, lines = read_toml(path)
        flat = _flatten(data, str(path), lines)

        def where(key: str) -> str:  # the key's line, in its section or at the top level
            line = lines.get((_FIELD_SECTION.get(key), key)) or lines.get((None, key))
            return f"{path}:{line}" if line else str(path)

        cfg.update(flat, where)
    return cfg.update(overrides or {}, override_source)


# -- command line -------------------------------------------------------------------------------------------

def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_arguments(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """`[CONFIG.toml]` plus one `--field-name` per field; only flags actually given end up in the namespace."""
    p.add_argument("config", nargs="?", help="TOML config file (optional); flags override it")
    p.add_argument("--print-config", action="store_true", help="print the effective config as TOML and exit")
    shown = TrainConfig().update(defaults or {})
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(f"[{section}]")
        for f in dataclasses.fields(cls):
            valid = range_text(f.metadata)
            help_text = f"{f.metadata['help']} ({valid + '; ' if valid else ''}default: {getattr(shown, f.name)!r})"
            kw: dict = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
            t = _field_type(f)
            if t is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif t is list:
                # integer lists take 0,3,8 as well as 0 3 8: strings here, split and typed by _coerce
                kw.update(nargs="+", type=str if f.metadata.get("type") is int else f.metadata.get("type", str),
                          metavar="V")
            elif t is dict:
                kw.update(nargs="+", type=str, metavar="KEY=VALUE")
            else:
                kw["type"] = t
                if "nargs" in f.metadata:
                    kw.update(nargs=f.metadata["nargs"], const=f.metadata["const"])
                if "choices" in f.metadata:
                    kw["choices"] = f.metadata["choices"]
            group.add_argument(_flag(f.name), **kw)


def config_from_args(args: argparse.Namespace, defaults: dict | None = None) -> TrainConfig:
    overrides = {k: v for k, v in vars(args).items() if k in _FIELD_SECTION}
    return load_config(getattr(args, "config", None), overrides, defaults, override_source=_flag)


def describe_config(defaults: dict | None = None) -> str:
    """A markdown reference of every field (docs/training.md embeds this table)."""
    shown = TrainConfig().update(defaults or {})
    out = ["| section | flag | default | valid | meaning |", "|---|---|---|---|---|"]
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = _toml_value(getattr(shown, f.name))
            valid = range_text(f.metadata) or ("one of " + ", ".join(f.metadata["choices"])
                                               if "choices" in f.metadata else "")
            out.append(f"| `[{section}]` | `{_flag(f.name)}` | `{default}` | {valid} | "
                       f"{f.metadata['help'].replace('|', '/')} |")
    return "\n".join(out)
