#!/usr/bin/env bash
# The main job on its embedded default, on 2 CPU ranks. Sets up .venv on first use.
# Each run starts fresh in runs/pretrain (the previous run is moved aside, to runs/pretrain/.replaced-*, never
# deleted) unless you pass --resume (continue it) or your own --overwrite / --no-overwrite.
source "$(dirname "$0")/env.sh"
fresh=(--overwrite)
for arg in "$@"; do
  case "$arg" in --resume*|--overwrite|--no-overwrite) fresh=() ;; esac
done
exec torchrun --nproc-per-node 2 -m tpzoo pretrain "${fresh[@]}" "$@"
