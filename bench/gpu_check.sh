#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py; its docstring says what it measures) from any directory, stopped at
# GPU_CHECK_LIMIT seconds (default 480, the 8 minutes it is sized for). Arguments go to the script, e.g. --cpu-smoke
# or --results DIR. PYTHON: the interpreter (default .venv/bin/python if there, else python).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
exec timeout --signal INT --kill-after 30 "${GPU_CHECK_LIMIT:-480}" "$python" bench/gpu_check.py "$@"
