"""`tpzoo generate CKPT --prompt "..." --max-new-tokens K`: decode with a KV cache, under tensor and pipeline
parallelism.

    tpzoo generate ckpt/ --prompt "Once upon a time" --max-new-tokens 50 --tp 2          # greedy
    tpzoo generate ckpt/ --prompt "..." --temperature 0.8 --top-p 0.95 --seed 1
    torchrun --nproc-per-node 4 -m tpzoo generate ckpt/ --prompt "..." --tp 2 --pp 2
    tpzoo generate ckpt/ --prompt "..." --greedy --draft mtp                            # self-speculative

Prints the prompt and its continuation, or --json. `--draft mtp` decodes with the model's multi-token-prediction
layers drafting (tpzoo/speculative.py: the same tokens as plain greedy decoding, or the same distribution when
sampling), then decodes plainly too and prints the drafts' acceptance rate and both speeds.
"""
from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt", help="tpzoo checkpoint or HF model directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default without --temperature)")
    p.add_argument("--temperature", type=float, help="sample with this temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (default 0: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same on every TP rank)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--tokenizer", help="tokenizer spec (default: the checkpoint's)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size of a mixture-of-experts model (default 1; spawns tp*pp*ep ranks, the "
                        "experts split over ep data-parallel replicas)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK with CUDA, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--dist-timeout", type=float, default=600.0,
                   help="seconds a rank may wait on another before the job fails naming it (default 600)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="shard activations along the sequence over the TP ranks; decoding then runs without a KV cache")
    p.add_argument("--draft", default="none", choices=["none", "mtp"],
                   help="mtp: self-speculative decoding, the multi-token-prediction layers drafting a token per "
                        "depth and the model verifying them in one forward (equal to plain decoding); prints the "
                        "acceptance rate and tokens/s beside plain decoding's")
    p.add_argument("--json", action="store_true", help="print one JSON line (ids and text)")


def _eos(ckpt, cfg):
    from tpzoo.errors import DataError

    gen = Path(ckpt) / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        except (ValueError, AttributeError) as e:  # invalid JSON, not UTF-8, or not an object
            raise DataError(f"{gen}: not a valid generation config ({e})") from None
        if eos is not None:
            return eos
    return cfg.eos_token_id


def _worker(args) -> None:
    import torch

    import tpzoo
    from tpzoo.checkpoint import load_model, parse_dtype
    from tpzoo.generation import generate
    from tpzoo.models import ModelLayout

    from ._common import decode, encode, load_tokenizer

    dims = tpzoo.init_parallel(tp=args.tp, pp=args.pp, ep=args.ep, device=args.device,
                               timeout=datetime.timedelta(seconds=args.dist_timeout))
    try:
        layout = ModelLayout(dims, sequence_parallel=args.sequence_parallel, dtype=parse_dtype(args.dtype))
        model = load_model(args.ckpt, layout, virtual_stages=1).eval()
        cfg = model.cfg
        tokenizer = load_tokenizer(args.tokenizer or args.ckpt)
        prompt_ids = encode(tokenizer, args.prompt, special_tokens=True)
        sample = args.temperature is not None and not args.greedy
        options = dict(dims=dims, greedy=not sample, temperature=args.temperature or 1.0, top_p=args.top_p,
                       top_k=args.top_k, seed=args.seed, eos_token_id=None if args.ignore_eos else _eos(args.ckpt, cfg))
        prompt = torch.tensor([prompt_ids], device="cpu")
        if args.draft == "mtp":  # both decodings timed warm (the first forwards pay one-time costs)
            generate(model, prompt, 2, **options)
        t0 = time.perf_counter()
        out = generate(model, prompt, args.max_new_tokens, **options)
        plain_s = time.perf_counter() - t0
        report = None
        if args.draft == "mtp":
            from tpzoo.speculative import generate_with_mtp

            plain = out
            t0 = time.perf_counter()
            out, stats = generate_with_mtp(model, prompt, args.max_new_tokens, **options)
            report = draft_report(stats, len(prompt_ids), plain, out, plain_s, time.perf_counter() - t0, sample)
        new_ids = out[0, len(prompt_ids):].tolist()
        if dims.rank == 0:
            text = decode(tokenizer, new_ids)
            if args.json:
                print(json.dumps({"prompt_ids": prompt_ids, "new_ids": new_ids, "completion": text,
                                  **({"draft": report} if report else {})}), flush=True)
            else:
                print(args.prompt + text, flush=True)
                if report:
                    print(draft_line(report), flush=True)
    finally:
        tpzoo.destroy_parallel()


def draft_report(stats: dict, prompt: int, plain, spec, plain_s: float, spec_s: float, sample: bool) -> dict:
    """What --draft mtp measured: the drafts kept, tokens per verifying forward, both decodings' speed."""
    new_plain, new_spec = plain.shape[1] - prompt, spec.shape[1] - prompt
    return {"drafted": stats["drafted"], "accepted": stats["accepted"],
            "acceptance": stats["accepted"] / max(stats["drafted"], 1),
            "tokens_per_step": (stats["accepted"] + stats["steps"]) / max(stats["steps"], 1),
            "tokens_per_s": new_spec / spec_s, "plain_tokens_per_s": new_plain / plain_s,
            "same_as_plain": None if sample else bool(plain.shape == spec.shape and (plain == spec).all())}


def draft_line(r: dict) -> str:
    same = "" if r["same_as_plain"] is None else f" | output {'equals' if r['same_as_plain'] else 'DIFFERS FROM'} plain"
    return (f"draft mtp: {r['accepted']}/{r['drafted']} drafts accepted ({100 * r['acceptance']:.1f}%), "
            f"{r['tokens_per_step']:.2f} tokens per forward | {r['tokens_per_s']:.1f} tokens/s vs plain "
            f"{r['plain_tokens_per_s']:.1f} ({r['tokens_per_s'] / max(r['plain_tokens_per_s'], 1e-9):.2f}x)" + same)


def run(args) -> int:
    """Preflight (tpzoo.train.preflight: sizes, the checkpoint's config against the layout),
    then the ranks: here before spawning them, or first thing on each rank under torchrun."""
    from tpzoo.train.preflight import check_generate, in_rank

    from .launch import run_multirank, under_torchrun

    if under_torchrun():
        return run_multirank(in_rank(check_generate, _worker), args, 1, "generate")
    check_generate(args)
    return run_multirank(_worker, args, args.tp * args.pp * args.ep, "generate")
