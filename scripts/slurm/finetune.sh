#!/usr/bin/env bash
# Multi-node supervised fine-tuning with Slurm (see pretrain.sh for the requirements):
#
#   sbatch --nodes 2 scripts/slurm/finetune.sh --base /shared/ckpt/step_00010000 --data /shared/sft.jsonl --tp 8
#SBATCH --job-name=tpzoo-finetune
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail

GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
HEAD_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
PORT="${MASTER_PORT:-29500}"
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}"
[ -f .venv/bin/activate ] && source .venv/bin/activate
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"

srun --kill-on-bad-exit=1 torchrun \
  --nnodes "$SLURM_NNODES" \
  --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-id "$SLURM_JOB_ID" \
  --rdzv-backend c10d \
  --rdzv-endpoint "$HEAD_NODE:$PORT" \
  -m tpzoo finetune "$@"
