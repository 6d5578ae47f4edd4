#!/usr/bin/env bash
# The main job on its embedded default, on 2 CPU ranks. Sets up .venv on first use.
source "$(dirname "$0")/env.sh"
exec torchrun --nproc-per-node 2 -m tpzoo pretrain "$@"
