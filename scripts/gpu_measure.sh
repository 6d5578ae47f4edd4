#!/usr/bin/env bash
# The GPU measurements of issue 36 as one command for a lent H200 (the device tool), under 10 minutes:
#   env        the GPU, torch, Triton, transformers, Liger
#   tests      the CUDA twins of the FP8 tests: the cast kernels with the hardware's conversion bit for bit against
#              torch's cast, an FP8 linear through torch._scaled_mm against the CPU emulation
#   fp8_8b     FP8 vs bf16, llama-3-8b cut to 8 layers, 200 steps of 2 x 2048: tokens/s, loss, peak memory
#   gpu_step   the training step, llama-3.2-1b bf16 micro 4 x 2048: tpzoo with and without --compile beside
#              transformers + torch.compile and + Liger, --profile (each tpzoo variant's split by category)
#   fp8_3b     FP8 vs bf16, llama-3.2-3b, 20 steps: tokens/s and peak memory, the top kernels of each variant
#   kernels    gpu_step.py --kernels' table on its own (the Triton kernels at llama-3.2-1b's shapes)
#   cp_ring, sft_packing, moe   the GPU benchmarks of issues 25 and 28 not measured yet (smaller runs)
# Each step runs under its own time cap (`timeout`; 560 s together at most), in this order, the most important
# first; a failing or cut step keeps the others, and the step-time benchmarks append each result to a .jsonl as
# it finishes. Everything goes under $OUT: gpu_measure.md (every benchmark's section, ready to merge into
# docs/benchmarks.md, and a table of the steps), gpu_measure.log (all output), fp8.jsonl, gpu_step.jsonl, env.txt.
#
#   bash scripts/gpu_measure.sh --fetch-wheels  # here, once per checkout: Liger's wheel into .whl/ (ignored by git);
#                                               # the device machine reaches no package index
#   run(command="bash scripts/gpu_measure.sh", carry=[".whl"], timeout_s=600)   # the device tool, on the H200
#   python scripts/bench/mdsection.py FILES_AT/gpu_measure.md docs/benchmarks.md  # back here: the sections in
#   bash scripts/gpu_measure.sh --dry-run       # here, on the CPU: every step at toy size (proves the script)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODE="gpu"
case "${1:-}" in
  --dry-run) MODE="dry" ;;
  --fetch-wheels) MODE="fetch" ;;
  "") ;;
  *) echo "usage: bash scripts/gpu_measure.sh [--dry-run | --fetch-wheels]" >&2; exit 2 ;;
esac
LIGER="liger-kernel==0.8.5"   # pure Python (Triton kernels); its needs (torch, triton) are on the device image

if [ "$MODE" = "fetch" ]; then
  EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"
  grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"
  exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl "$LIGER"
fi

if [ "$MODE" = "dry" ]; then
  source "$ROOT/scripts/env.sh"          # the CPU .venv
  PY=python
  OUT="${OUT:-$ROOT/runs/gpu_measure_dry}"
else
  PY=python3                             # the device image's torch (CUDA)
  OUT="${OUT:?the device tool sets OUT}"
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  python3 -c "import tpzoo.models" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e .
fi
mkdir -p "$OUT"
MD="$OUT/gpu_measure.md" LOG="$OUT/gpu_measure.log"
rm -f "$MD" "$LOG" "$OUT/fp8.jsonl" "$OUT/gpu_step.jsonl"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
STEPS=()

step() {  # step NAME CAP_SECONDS COMMAND...: run it under its cap, log it, note how it ended
  local name="$1" cap="$2"; shift 2
  local t0=$SECONDS rc
  echo "=== $name (cap ${cap} s): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$cap" "$@" >>"$LOG" 2>&1
  rc=$?
  local how="ok"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && how="cut at its ${cap} s cap"
  [ $rc -ne 0 ] && [ "$how" = "ok" ] && how="failed (exit $rc)"
  echo "=== $name: $how, $((SECONDS - t0)) s" | tee -a "$LOG"
  local shown="$*"
  STEPS+=("| $name | $how | $((SECONDS - t0)) | \`${shown:0:300}\` |")
}

B=scripts/bench
ENV_PROBE='import torch, sys, importlib; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"); [print(m, getattr(importlib.import_module(m), "__version__", "?") if importlib.util.find_spec(m) else "missing") for m in ("triton", "transformers", "liger_kernel", "peft")]'
step env 15 $PY -c "$ENV_PROBE"
$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" \
  > "$OUT/env.txt" 2>&1; command -v nvidia-smi >/dev/null && nvidia-smi >> "$OUT/env.txt" 2>&1

if [ "$MODE" = "gpu" ]; then
  step tests 60 $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py::test_cuda_fp8_casts tests/test_fp8.py -m cuda
  step fp8_8b 150 $PY $B/fp8.py --device cuda --models llama-3-8b-8l --steps 200 --warmup 10 \
    --jsonl "$OUT/fp8.jsonl" --write "$MD" --section fp8_cuda_issue36
  step gpu_step 170 $PY $B/gpu_step.py --model llama-3.2-1b --micro 4 --seq 2048 --steps 6 --warmup 3 \
    --impls tpzoo tpzoo-compile hf-compile hf-liger --profile --jsonl "$OUT/gpu_step.jsonl" --write "$MD" \
    --section gpu_step_cuda
  step fp8_3b 50 $PY $B/fp8.py --device cuda --models llama-3.2-3b --steps 20 --warmup 8 --profile 12 \
    --jsonl "$OUT/fp8.jsonl" --write "$MD" --section fp8_cuda_issue36_3b
  # gpu_step.py --kernels, as its own step (llama-3.2-1b's shapes at 8192 tokens): a cut here keeps the table above
  step kernels 35 $PY $B/kernels.py --no-compile --tokens 8192 --seq 2048 --hidden 2048 --ffn 8192 --heads 32 \
    --head-dim 64 --vocab-shard 128256
  step cp_ring 20 $PY $B/cp_ring.py --device cuda --write "$MD"
  step sft_packing 30 $PY $B/sft_packing.py --device cuda --model llama-3.2-1b --seq-len 2048 --dtype bf16 \
    --micro-batch-size 8 --examples 600 --steps 6 --write "$MD"
  step moe 30 $PY $B/moe.py --device cuda --steps 3 --write "$MD"
else  # the same steps at toy sizes on the CPU
  step tests 120 $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py::test_cuda_fp8_casts tests/test_fp8.py -m cuda
  step fp8_8b 300 $PY $B/fp8.py --steps 6 --warmup 2 --jsonl "$OUT/fp8.jsonl" --write "$MD" --section fp8_cuda_issue36
  step gpu_step 600 $PY $B/gpu_step.py --device cpu --model nano-llama --micro 2 --seq 64 --steps 2 --warmup 1 \
    --impls tpzoo tpzoo-compile hf-bf16 hf-liger --profile --jsonl "$OUT/gpu_step.jsonl" --write "$MD" \
    --section gpu_step_cuda
  step fp8_3b 300 $PY $B/fp8.py --steps 4 --warmup 1 --variants none,rowwise --profile 5 \
    --jsonl "$OUT/fp8.jsonl" --write "$MD" --section fp8_cuda_issue36_3b
  step kernels 120 env TRITON_INTERPRET=1 $PY $B/kernels.py --no-compile --tokens 64 --seq 16 --hidden 64 --ffn 128 --heads 4 \
    --head-dim 16 --vocab-shard 256
  step cp_ring 300 $PY $B/cp_ring.py --device cpu --seq 512 --cp 2 --reps 1 --write "$MD"
  step sft_packing 300 $PY $B/sft_packing.py --device cpu --examples 40 --steps 2 --seq-len 64 --write "$MD"
  step moe 300 $PY $B/moe.py --device cpu --steps 2 --write "$MD"
fi

{
  echo
  echo "<!-- gpu_measure_steps:begin -->"
  echo "## The GPU measurement run (scripts/gpu_measure.sh$([ "$MODE" = dry ] && echo ' --dry-run'))"
  echo
  echo "$(head -1 "$OUT/env.txt"); $(date -u +%Y-%m-%dT%H:%MZ). Each step under its own time cap; the log is gpu_measure.log."
  echo
  echo "| step | how it ended | seconds | command |"
  echo "|---|---|---|---|"
  printf '%s\n' "${STEPS[@]}"
  echo "<!-- gpu_measure_steps:end -->"
} >> "$MD"
echo "wrote $MD and $LOG in ${SECONDS} s"
