#!/usr/bin/env bash
# Create .venv (if needed) and install refcache with its dev extra. On CPU-only machines the constraints file pins
# the CPU wheel of torch; on a GPU machine set REFCACHE_CONSTRAINTS= (empty) to get the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CONSTRAINTS=${REFCACHE_CONSTRAINTS-constraints-cpu.txt}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q ${CONSTRAINTS:+-c "$CONSTRAINTS"} -e ".[dev]"
