#!/usr/bin/env bash
# Multi-node pretraining with Slurm: one torchrun per node, torchrun starts one process per GPU.
#
#   sbatch --nodes 4 scripts/slurm/pretrain.sh scripts/configs/llama-3-8b-gpu.toml [--key value ...]
#
# Requirements: the repository (and its venv, see scripts/env.sh) and the --save / --data-cache directories on a
# file system every node sees (rank 0 writes the manifest and renames each checkpoint into place; every rank
# writes its own shard). Resubmitting the same job continues from the newest checkpoint when the config says
# resume = "latest" (or pass --resume).
#SBATCH --job-name=tpzoo-pretrain
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

# NCCL on InfiniBand/RoCE clusters usually wants the right interface; uncomment and adapt if needed:
# export NCCL_SOCKET_IFNAME=ib0
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
export TPZOO_DIST_TIMEOUT="${TPZOO_DIST_TIMEOUT:-1800}"   # seconds before a stuck collective fails the job

srun --kill-on-bad-exit=1 torchrun \
  --nnodes "$SLURM_NNODES" \
  --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-id "$SLURM_JOB_ID" \
  --rdzv-backend c10d \
  --rdzv-endpoint "$HEAD_NODE:$PORT" \
  -m tpzoo pretrain "$@"
