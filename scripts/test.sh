#!/usr/bin/env bash
# The test command: set up .venv, lint (ruff, configured in pyproject.toml), then run the whole suite. Exits non-zero
# on any lint finding, any failure, and when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# audit-ref --html's test renders the page in a real headless browser: Debian's chromium, installed when missing and
# the tests run as root (elsewhere the test is skipped; install it with: apt-get install chromium).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "test.sh: could not install chromium; the HTML view's browser test will be skipped" >&2
fi
# torch.compile on CPU (precompute-ref / train-dpo --torch-compile, and their tests) builds its kernels with a C++
# compiler: Debian's g++, installed when missing and the tests run as root (elsewhere: apt-get install g++).
if ! command -v g++ >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq g++; } >/dev/null 2>&1 \
    || echo "test.sh: could not install g++; torch.compile on CPU (--torch-compile) will not work" >&2
fi
export HF_HUB_OFFLINE=1
.venv/bin/python -m ruff check --quiet .
.venv/bin/python -m pytest -q "$@"
