#!/usr/bin/env bash
# The test suite (multi-rank tests run on gloo, on CPU). Sets up .venv on first use.
source "$(dirname "$0")/env.sh"
exec python -m pytest -q "$@"
