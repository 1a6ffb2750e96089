#!/usr/bin/env bash
# Set up a virtual environment with kvtier and everything its tests, server,
# plots and the remote tier need. On machines without a GPU the CPU build of torch is used:
# KVTIER_TORCH (default "torch==2.13.0") picks the torch requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "${KVTIER_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ".[test,serve,plots,remote]"
echo "kvtier installed in .venv"
