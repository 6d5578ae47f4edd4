"""`tpzoo plot RUN_DIR [--out FILE.png]`: loss (and held-out loss) and learning rate per step, from a run's
metrics.jsonl (written with --log-dir, or into --save by default), as one PNG (matplotlib, Agg backend: no display
needed). A torn line in metrics.jsonl (a crashed run, or one still writing) is skipped with a warning."""
from __future__ import annotations

import argparse
import os

from tpzoo.errors import DataError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="directory holding metrics.jsonl (a run's --log-dir or --save)")
    p.add_argument("--out", default=None, help="output PNG (default: RUN_DIR/curves.png)")


def plot(run_dir: str, out: str | None = None) -> str:
    """Write the PNG and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tpzoo.train.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir) if "loss" in r and "lr" in r]  # torn lines are already skipped
    if not rows:
        raise DataError(f"{os.path.join(run_dir, 'metrics.jsonl')} has no rows with a loss and a learning rate")
    steps = [r["step"] for r in rows]
    loss = [float(r["loss"]) for r in rows]
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[2, 1])
    ax_loss.plot(steps, loss, label="train loss", linewidth=1)
    evals = [(r["step"], float(r["eval_loss"])) for r in rows if r.get("eval_loss") is not None]
    if evals:
        ax_loss.plot(*zip(*evals), "o-", label="held-out loss")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_lr.plot(steps, [r["lr"] for r in rows], color="tab:orange", linewidth=1)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    out = out or os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def run(args) -> int:
    from tpzoo.errors import UserError

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("matplotlib is not installed (pip install matplotlib, or tpzoo[plot])") from None
    out = plot(args.run_dir, args.out)
    print(f"wrote {out}")
    return 0
