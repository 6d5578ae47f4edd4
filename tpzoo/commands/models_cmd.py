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
    from ._common import aligned

    table = [["name", "family", "params", "active", "layers", "hidden", "heads", "kv", "vocab", " hf source"]]
    for name, cfg in rows:
        active = human_count(cfg.num_parameters(active=True)) if cfg.num_experts else "="
        table.append([name, cfg.family, human_count(cfg.num_parameters()), active, *map(str, (
            cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size)),
            f" {cfg.hf_source or '-'}"])
    print("\n".join(aligned(table, right=set(range(2, 9)))))
    return 0
