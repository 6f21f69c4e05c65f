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
# audit-ref --html's test renders the page in a real headless browser: Debian's chromium, installed when missing and
# this runs as root (elsewhere the test is skipped; install it with: apt-get install chromium).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "setup.sh: could not install chromium; the HTML view's browser test will be skipped" >&2
fi
# torch.compile on CPU (precompute-ref / train-dpo --torch-compile, and their tests) builds its kernels with a C++
# compiler: Debian's g++, installed when missing and this runs as root (elsewhere: apt-get install g++).
if ! command -v g++ >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq g++; } >/dev/null 2>&1 \
    || echo "setup.sh: could not install g++; torch.compile on CPU (--torch-compile) will not work" >&2
fi
