"""`tpzoo plan`: rank the parallel layouts of a model on a cluster by estimated step time (memory checked).

    tpzoo plan --model llama-3-8b --gpus 8 --gpu-memory 80 --seq-len 8192 --global-batch-size 128
    tpzoo plan --model my_config.json --gpus 64 --gpu-memory 80 --seq-len 4096 --global-batch-size 512 --json

The model is a registry name (`tpzoo.models.list_configs()`), a ModelConfig JSON, or a Hugging Face
config.json. --seq-len defaults to 4096 and --global-batch-size to the sequences of 4M tokens (1024 at 4096), the
pretraining batch of Llama 2 and 3. Layouts whose memory floor is over the GPU's memory are not estimated
(tpzoo/plan/bound.py); when none fits, the line after the table says which flag would make one fit. Runs on one
process, no GPU needed; see docs/plan.md for the model behind the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


DEFAULT_SEQ_LEN = 4096
DEFAULT_TOKENS_PER_STEP = 4 * 2 ** 20  # Llama 2 and 3 pretrained on 4M-token batches


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="registry name, ModelConfig JSON or HF config.json")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu-memory", type=float, required=True, help="GiB per GPU")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-tflops", type=float, default=989.0, help="dense peak TFLOP/s in --dtype (H100: 989)")
    p.add_argument("--intra-node-bw", type=float, default=450.0, help="GB/s per GPU per direction (NVLink)")
    p.add_argument("--inter-node-bw", type=float, default=50.0, help="GB/s per GPU per direction (network)")
    p.add_argument("--efficiency", type=float, default=0.6, help="achieved fraction of peak FLOP/s (default 0.6)")
    p.add_argument("--reserve-gib", type=float, default=3.0, help="memory kept for CUDA/NCCL/workspaces")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help=f"tokens per sequence (default "
                   f"{DEFAULT_SEQ_LEN})")
    p.add_argument("--global-batch-size", type=int, help=f"sequences per optimizer step (default: "
                   f"{DEFAULT_TOKENS_PER_STEP // 2 ** 20}M tokens' worth, {DEFAULT_TOKENS_PER_STEP // DEFAULT_SEQ_LEN} "
                   f"at {DEFAULT_SEQ_LEN})")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="ZeRO level: 1 shards fp32 master + AdamW states over dp, 2 the fp32 gradients too, 3 the "
                        "weights too (layers gathered when used)")
    p.add_argument("--zero1", action="store_true", help="alias of --zero 1")
    p.add_argument("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false",
                   help="model the data-parallel reduction after the backward instead of overlapped with it")
    p.add_argument("--no-grad-accumulation-fusion", dest="grad_accumulation_fusion", action="store_false",
                   help="model the 16-bit weight gradients autograd holds without gradient-accumulation fusion")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="LoRA fine-tuning of a frozen base at this adapter rank (all-linear targets)")
    p.add_argument("--lora-experts", action="store_true",
                   help="with --lora-rank: one adapter per routed expert of a mixture of experts too (as `tpzoo "
                        "finetune --lora-experts`): their memory and FLOPs per ep rank")
    p.add_argument("--base-dtype", choices=["fp8", "int4"],
                   help="with --lora-rank: the frozen base kept quantized (convert from-hf --keep-quantized): its "
                        "projections and experts in block FP8 or int4 with their scales, the rest in --dtype")
    p.add_argument("--objective", default="lm", choices=["lm", "dpo", "distill"],
                   help="fine-tuning objective (tpzoo.post): dpo holds a frozen reference copy of the model (not "
                        "with --lora-rank, whose reference is the base without adapters, nor with "
                        "--dpo-precompute-ref); distill holds --teacher and computes the student's logits unfused")
    p.add_argument("--dpo-precompute-ref", action="store_true",
                   help="DPO with the reference log-probabilities computed before training (no reference model held)")
    p.add_argument("--teacher", help="distill: the teacher (registry name, ModelConfig JSON or HF config.json); "
                   "omitted: a `tpzoo distill-cache` (no teacher held)")
    p.add_argument("--kernels", default="fused", choices=["fused", "reference"],
                   help="fused = Triton (CUDA), reference = torch (what CPU runs)")
    p.add_argument("--no-fused-linear-cross-entropy", dest="fused_linear_cross_entropy", action="store_false",
                   help="model the unfused head (full logits, then the loss) instead of the fused default")
    p.add_argument("--fp8", default="none", choices=["none", "tensorwise", "rowwise"],
                   help="the attention and MLP projections' GEMMs in FP8 (twice the FLOP rate; the casts' working "
                        "set in memory), as `tpzoo pretrain --fp8` runs them")
    p.add_argument("--compile", action="store_true", help="the blocks compiled (regional torch.compile, as "
                        "`tpzoo pretrain --compile`): their saved tensors counted as the fused kernels'")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                   help="muon: one fp32 momentum for the hidden layers' matrices instead of two moments, and the "
                        "orthogonalization (FLOPs and its bf16 exchange over tp and dp) in the step time, as "
                        "`tpzoo pretrain --optimizer muon` runs it")
    p.add_argument("--muon-ns-steps", type=int, default=5, help="Muon's Newton-Schulz iterations")
    p.add_argument("--vocab-padding-multiple", type=int, default=1)
    p.add_argument("--max-micro-batch", type=int, default=64)
    p.add_argument("--mtp-layers", type=int, default=-1,
                   help="multi-token-prediction depths on the last stage (docs/models.md; -1 = the model's own: an "
                        "HF config.json's num_nextn_predict_layers / mtp_num_hidden_layers; 0 = none)")
    p.add_argument("--tp", type=int, help="only layouts with this tp")
    p.add_argument("--pp", type=int, help="only layouts with this pp")
    p.add_argument("--cp", type=int, help="only layouts with this context-parallel size (default: cp is searched "
                   "for sequences of 16384 tokens or more)")
    p.add_argument("--ep", type=int, help="only layouts with this expert-parallel size (mixture of experts; default: "
                   "every ep dividing the experts and dp)")
    p.add_argument("--pp-boundaries", help="the pipeline split, first layer of each model stage and the end "
                   "(0,3,8,...: pp * virtual stages ranges; default: the split tpzoo trains with, balanced by "
                   "parameters, and for models whose layers differ also the split balanced by time)")
    p.add_argument("--stages", action="store_true", help="print each pipeline stage's layers, memory and time for "
                   "the best layout (always when the model's layers differ or --pp-boundaries is given)")
    p.add_argument("--recompute", choices=["none", "selective", "full"], help="only this recompute mode")
    p.add_argument("--replicas", type=int, default=1,
                   help="plan K replicas joined by a slow link (DiLoCo, `pretrain --replicas`): each replica is "
                        "gpus/K GPUs training global-batch/K sequences; synchronous vs DiLoCo, and the "
                        "recommended --sync-every / --sync-fragments (docs/plan.md)")
    p.add_argument("--replica-link-gbps", type=float, help="gigabits per second each rank gets across replicas")
    p.add_argument("--replica-link-latency-ms", type=float, default=0.0, help="latency of the link (default 0)")
    p.add_argument("--sync-every", type=int, default=0, help="also estimate DiLoCo with this H")
    p.add_argument("--sync-fragments", type=int, default=1, help="... with this many fragments")
    p.add_argument("--sync-overlap", type=int, default=0, help="... with this overlap (steps)")
    p.add_argument("--sync-dtype", default="fp32", choices=["fp32", "bf16", "fp8"],
                   help="dtype of DiLoCo's outer gradients on the link (also for the recommendation)")
    p.add_argument("--top", type=int, default=10, help="how many fitting layouts to show (default 10)")
    p.add_argument("--rejected", type=int, default=5, help="how many non-fitting layouts to show (default 5)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def load_model(spec: str):
    """A ModelConfig from a registry name, a ModelConfig JSON file or a HF config.json."""
    from tpzoo.models import ModelConfig, from_hf_config, get_config

    if not (os.path.exists(spec) or spec.endswith(".json")):
        return get_config(spec)
    with open(spec) as f:
        d = json.load(f)
    if "family" in d and "hidden_size" in d and "model_type" not in d:
        cfg = ModelConfig.from_dict(d)
    else:
        cfg = from_hf_config(d)
    if not cfg.name:
        cfg.name = os.path.splitext(os.path.basename(spec))[0]
    return cfg


def frozen_models(args, cfg) -> tuple:
    """The frozen models a post-training objective holds beside the trained one (tpzoo.plan.post)."""
    from tpzoo.errors import ConfigError

    if args.teacher and args.objective != "distill":
        raise ConfigError(f"--teacher is for --objective distill (the objective is {args.objective!r})")
    if args.objective == "dpo" and not args.lora_rank and not args.dpo_precompute_ref:
        return (cfg,)  # a frozen copy of the model
    if args.objective == "distill" and args.teacher:
        return (load_model(args.teacher),)
    return ()


def parse_boundaries(text: str | None) -> tuple[int, ...] | None:
    """--pp-boundaries 0,3,8 as integers (checked against the model by the search)."""
    from tpzoo.errors import ConfigError

    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--pp-boundaries {text!r}: expected comma-separated layer indices, e.g. 0,3,8") from None


def run(args) -> int:
    from tpzoo.errors import ConfigError
    from tpzoo.plan import ClusterSpec, TrainingSpec, search
    from tpzoo.plan.report import header, table, to_json

    cfg = load_model(args.model)
    if args.mtp_layers >= 0:  # (the depths' blocks, projections and head passes: tpzoo/plan/memory.py)
        from tpzoo.models.config import MTPConfig

        cfg = cfg.replace(mtp=MTPConfig(args.mtp_layers) if args.mtp_layers else None)
    if args.global_batch_size is None:
        args.global_batch_size = max(1, DEFAULT_TOKENS_PER_STEP // max(args.seq_len, 1))
    k = args.replicas
    if k > 1 and (args.gpus % k or args.global_batch_size % k or args.replica_link_gbps is None):
        raise ConfigError(f"--replicas {k}: " + ("--replica-link-gbps is required (the link between replicas)"
                                                 if args.replica_link_gbps is None else
                                                 f"must divide --gpus {args.gpus} and --global-batch-size "
                                                 f"{args.global_batch_size} (each replica trains its share)"))
    try:
        spec = None
        if k > 1:  # plan one replica; replicas.py adds the link
            from tpzoo.plan.replicas import ReplicaSpec

            spec = ReplicaSpec(k, args.replica_link_gbps, args.replica_link_latency_ms, args.sync_every,
                               args.sync_fragments, args.sync_overlap, args.sync_dtype)
            args.gpus, args.global_batch_size = args.gpus // k, args.global_batch_size // k
        cluster = ClusterSpec(gpus=args.gpus, gpu_memory_gib=args.gpu_memory, gpus_per_node=args.gpus_per_node,
                              gpu_tflops=args.gpu_tflops, intra_node_gbps=args.intra_node_bw,
                              inter_node_gbps=args.inter_node_bw, efficiency=args.efficiency,
                              reserve_gib=args.reserve_gib)
        training = TrainingSpec(seq_len=args.seq_len, global_batch_size=args.global_batch_size, dtype=args.dtype,
                                zero=max(args.zero, int(args.zero1)),
                                overlap_grad_reduce=args.overlap_grad_reduce,
                                grad_accumulation_fusion=args.grad_accumulation_fusion,
                                lora_rank=args.lora_rank, lora_experts=args.lora_experts,
                                base_dtype=args.base_dtype,
                                vocab_padding_multiple=args.vocab_padding_multiple,
                                kernels=args.kernels,  # distillation's student computes its logits unfused
                                fused_linear_cross_entropy=(args.fused_linear_cross_entropy
                                                            and args.objective != "distill"),
                                fp8=args.fp8, compile=args.compile, frozen=frozen_models(args, cfg),
                                optimizer=args.optimizer, muon_ns_steps=args.muon_ns_steps)
    except ValueError as exc:  # the specs check their own fields
        raise ConfigError(str(exc)) from None
    only = dict(tp=args.tp, pp=args.pp, recompute=args.recompute, cp=args.cp, ep=args.ep,
                boundaries=parse_boundaries(args.pp_boundaries))
    estimates = search(cfg, cluster, training, args.max_micro_batch, progress=sys.stderr.isatty(), **only)
    fitting = [e for e in estimates if e.fits]
    hint = None
    if estimates and not fitting:
        from tpzoo.plan.hints import fit_hint

        hint = fit_hint(cfg, cluster, training, args.max_micro_batch, **only)
    across = best = None
    if spec is not None and fitting:
        from tpzoo.plan import replicas

        best, across = replicas.plan_replicas(cfg, fitting, cluster, training, spec)
    if args.json:
        out = json.loads(to_json(cfg, cluster, training, estimates, args.top, args.rejected))
        out["layouts_ruled_out"] = estimates.ruled_out
        if hint:
            out["hint"] = hint
        if spec is not None:
            import dataclasses

            out["replicas"] = {"spec": dataclasses.asdict(spec), "layout": best.layout.to_dict() if best else None,
                               "forms": [r.to_dict() for r in across or []]}
        print(json.dumps(out, indent=2))
    else:
        print(header(cfg, cluster, training, estimates.considered, len(fitting), estimates.ruled_out)
              + (f"\n(one of {k} replicas: {args.gpus * k} GPUs, global batch {args.global_batch_size * k} in all)"
                 if spec else ""))
        print()
        from tpzoo.plan.balance import layers_differ

        with_stages = args.stages or args.pp_boundaries is not None or layers_differ(cfg)
        print(table(estimates, args.top, args.rejected, with_stages))
        if hint:
            print(f"\nnothing fits: {hint}")
        if spec is not None:
            from tpzoo.plan import replicas

            print()
            print(replicas.table(cfg, best, across, spec, fitting.index(best) + 1) if across else
                  f"across {k} replicas: nothing to compare, no layout of one replica fits")
    if not estimates:
        print("tpzoo plan: no valid layout (check gpus, heads, batch size divisibility)", file=sys.stderr)
        return 1
    return 0
