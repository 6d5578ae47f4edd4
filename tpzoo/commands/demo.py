"""TP=2 on CPU: a column->GeLU->row MLP, a vocab-parallel embedding and the vocab-parallel loss, each checked
against its dense single-process twin built from the same full weights."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--sequence-parallel", action="store_true", help="shard activations along the sequence")
    p.add_argument("--seed", type=int, default=0)


def _demo(args) -> None:
    import torch
    import torch.nn.functional as F

    import tpzoo
    from tpzoo.parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        count_collectives,
        gather_tp_param,
        get_tp_rank,
        get_tp_size,
        vocab_parallel_cross_entropy,
    )

    state = tpzoo.init_parallel(tp=args.tp)
    torch.manual_seed(args.seed)
    vocab, hidden, seq = 1000, 64, 16
    sp = args.sequence_parallel
    emb = VocabParallelEmbedding(vocab, hidden, sequence_parallel=sp)
    up = ColumnParallelLinear(hidden, 4 * hidden, sequence_parallel=sp)
    down = RowParallelLinear(4 * hidden, hidden, sequence_parallel=sp)
    head = ColumnParallelLinear(hidden, emb.num_embeddings_padded, bias=False, sequence_parallel=sp)
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1), device="cpu").to(state.device)
    target = ids.roll(-1, dims=1)

    with count_collectives() as counter:
        h = emb(ids)
        h = h + down(F.gelu(up(h)))
        logits = head(h)
        loss_tp = vocab_parallel_cross_entropy(logits, target, vocab_size=vocab).mean()
        loss_tp.backward()

    full = {name: gather_tp_param(p) for name, p in
            (("emb", emb.weight), ("up_w", up.weight), ("up_b", up.bias), ("down_w", down.weight),
             ("head", head.weight))}
    grads = {name: gather_tp_param(p, grad=True) for name, p in
             (("up_w", up.weight), ("down_w", down.weight), ("head", head.weight))}
    # The dense twin: plain torch ops on the gathered full weights.
    dense = {k: v.clone().requires_grad_() for k, v in full.items()}
    hd = F.embedding(ids, dense["emb"][:vocab])
    hd = hd + F.linear(F.gelu(F.linear(hd, dense["up_w"], dense["up_b"])), dense["down_w"], down.bias.detach())
    loss_dense = F.cross_entropy(F.linear(hd, dense["head"])[..., :vocab].reshape(-1, vocab), target.reshape(-1))
    loss_dense.backward()

    if state.rank == 0:
        print(f"tpzoo demo: tp={get_tp_size()} sequence_parallel={sp} (rank {get_tp_rank()} of {state.world_size})")
        print(f"  loss  tp={loss_tp.item():.6f}  dense={loss_dense.item():.6f}  "
              f"|diff|={abs(loss_tp.item() - loss_dense.item()):.2e}")
        worst = 0.0
        for k, g in grads.items():
            d = (g - dense[k].grad).abs().max().item()
            worst = max(worst, d)
            print(f"  grad {k:7s} max|diff| = {d:.2e}")
        print("  collectives per rank:", ", ".join(f"{k}: {v['calls']} calls, {v['payload_bytes']} B"
                                                  for k, v in counter.summary().items()) or "none")
        ok = abs(loss_tp.item() - loss_dense.item()) < 1e-5 and worst < 1e-5
        print("  MATCH: the parallel layers equal their dense twin" if ok else "  MISMATCH")
        if not ok:
            raise SystemExit(1)
    tpzoo.destroy_parallel()


def run(args) -> int:
    from .launch import run_multirank

    return run_multirank(_demo, args, args.tp, "demo")
