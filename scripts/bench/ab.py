"""Before vs after: tpzoo's training step at two revisions of the code, on the same machine, in one invocation.

    python scripts/bench/ab.py --before 81f477f                    # this checkout against that commit
    python scripts/bench/ab.py --before 81f477f --repeats 7 --write docs/benchmarks.md

Each case is scripts/bench/train.py's tpzoo step (forward, backward, global-norm clipping, AdamW; `--impl tpzoo`)
in a fresh process, this checkout's script running each revision's code (the harness is the same for both), the two
revisions alternating run after run (before, after, before, after, ...), so machine load drifts over both alike;
the report is the median over the runs of each run's median step time, and the ratio after / before; beside it
the step's CPU time (the process's, rank 0's at tp > 1: what a busy machine disturbs least) and the CPU time of the
whole run (all its processes: start, imports, model build, warm-up and timed steps). The other revision is a plain
copy of the commit (`git archive`) put first on PYTHONPATH; both read the same random HF model (made once).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

from mdsection import write_section  # noqa: E402 (a sibling script module)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (label, model, tp, extra train.py flags)
CASES = [("bench-llama, tp=1", "bench-llama", 1, []),
         ("bench-llama, tp=2 + SP", "bench-llama", 2, ["--sequence-parallel"]),
         ("tiny-mixtral (router loss), tp=1", "tiny-mixtral", 1, [])]


def checkout(rev: str, into: str) -> str:
    """A plain copy of `rev` whose tpzoo package holds its models/ and kernels/ (as an install would)."""
    os.makedirs(into, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    for name in ("models", "kernels"):
        os.symlink(os.path.join("..", name), os.path.join(into, "tpzoo", name))
    return into


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(tree: str, model: str, tp: int, extra: list, hf_dir: str, args) -> tuple[float, float, float]:
    """(median step seconds, median step CPU seconds, CPU seconds of the whole run) of one case at one revision."""
    script = os.path.join(ROOT, "scripts", "bench", "train.py")
    launcher = [sys.executable] if tp == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                                                 str(tp)]
    cmd = launcher + [script, "--impl", "tpzoo", "--model", model, "--hf-dir", hf_dir, "--steps", str(args.steps),
                      "--warmup", str(args.warmup)] + extra
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    cpu = _children_cpu()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    cpu = _children_cpu() - cpu
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{tree} {model} tp={tp} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    result = json.loads(lines[-1][7:])
    return result["step_s_median"], result["step_cpu_s_median"], cpu


def make_hf(model: str, path: str) -> None:
    """The case's random HF model, written by this checkout's train.py (the same files for both revisions)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))
    import train

    train.make_hf_model(argparse.Namespace(model=model), path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the git revision to compare this checkout with")
    p.add_argument("--repeats", type=int, default=5, help="runs of each case and revision, alternating")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--write", metavar="MD", help="also write the table into this markdown file (its own section)")
    p.add_argument("--section", default="ab_kinds", help="--write: the section's name")
    p.add_argument("--title", default="Training step before and after the layer-kinds restructuring (CPU)",
                   help="--write: the section's heading")
    args = p.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tpzoo-ab-") as tmp:
        before = checkout(args.before, os.path.join(tmp, "before"))
        hf = {m: os.path.join(tmp, f"hf-{m}") for m in {c[1] for c in CASES}}
        for model, path in hf.items():
            make_hf(model, path)
        times = {(label, which): [] for label, *_ in CASES for which in ("before", "after")}
        for _ in range(args.repeats):
            for label, model, tp, extra in CASES:
                for which, tree in (("before", before), ("after", ROOT)):
                    times[(label, which)].append(run(tree, model, tp, extra, hf[model], args))
                    step, step_cpu, cpu = times[(label, which)][-1]
                    print(f"{label} {which}: step {step:.4f} s ({step_cpu:.4f} CPU s), run {cpu:.1f} CPU s",
                          file=sys.stderr, flush=True)
    head = (f"Command: `python scripts/bench/ab.py --before {args.before} --repeats {args.repeats} --steps {args.steps}"
            f" --write docs/benchmarks.md{'' if args.section == 'ab_kinds' else ' --section ' + args.section}`. "
            f"scripts/bench/train.py's tpzoo training step (float32, batch 4 x 256, one "
            f"torch thread per process) at revision {args.before} (before) and at this checkout (after), this "
            f"checkout's script on each revision's code in a fresh process, alternating {args.repeats} times; each run "
            f"reports its median of {args.steps} steps after {args.warmup} warm-up (wall and the process's CPU time), "
            f"the table the median over runs. Load average when it started: {load:.1f} (a shared 2-core machine: the "
            f"spread of the after runs' steps is in the fifth column; CPU times vary less).")
    rows = ["| case | step before | step after | after / before | steps after (min-max) | step CPU before | "
            "step CPU after | after / before | run CPU before | run CPU after | after / before |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, *_ in CASES:
        (b, a), (sb, sa), (cb, ca) = ([statistics.median(t[i] for t in times[(label, w)]) for w in ("before", "after")]
                                      for i in (0, 1, 2))
        after = [t[0] for t in times[(label, "after")]]
        rows.append(f"| {label} | {b:.3f} s | {a:.3f} s | {a / b:.3f} | {min(after):.3f}-{max(after):.3f} s | "
                    f"{sb:.3f} s | {sa:.3f} s | {sa / sb:.3f} | {cb:.1f} s | {ca:.1f} s | {ca / cb:.3f} |")
    text = head + "\n\n" + "\n".join(rows)
    print("\n" + text)
    if args.write:
        write_section(args.write, args.section, f"## {args.title}\n\n" + text)


if __name__ == "__main__":
    main()
