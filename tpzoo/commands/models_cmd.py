"""`tpzoo models`: the named configs of the registry, with parameter counts and the HF source of each."""
from __future__ import annotations

import argparse
import json

from tpzoo.progress import human_count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--family", help="only this family (gpt2, llama, mistral, qwen2, ...)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")


def run(args) -> int:
    from tpzoo.models.registry import list_configs

    rows = [(name, cfg) for name, cfg in list_configs().items() if not args.family or cfg.family == args.family]
    if args.json:
        for name, cfg in rows:
            print(json.dumps({"name": name, "family": cfg.family, "parameters": cfg.num_parameters(),
                              "active_parameters": cfg.num_parameters(active=True), "experts": cfg.num_experts,
                              "layers": cfg.num_layers, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
                              "kv_heads": cfg.num_kv_heads, "vocab": cfg.vocab_size, "hf_source": cfg.hf_source}))
        return 0
    print(f"{'name':16s} {'family':9s} {'params':>8s} {'active':>8s} {'layers':>6s} {'hidden':>6s} {'heads':>5s} {'kv':>3s} "
          f"{'vocab':>7s}  hf source")
    for name, cfg in rows:
        active = human_count(cfg.num_parameters(active=True)) if cfg.num_experts else "="
        print(f"{name:16s} {cfg.family:9s} {human_count(cfg.num_parameters()):>8s} {active:>8s} {cfg.num_layers:>6d} "
              f"{cfg.hidden_size:>6d} {cfg.num_heads:>5d} {cfg.num_kv_heads:>3d} {cfg.vocab_size:>7d}  "
              f"{cfg.hf_source or '-'}")
    return 0
