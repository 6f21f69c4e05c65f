#!/usr/bin/env bash
# The test command: set up .venv, lint (ruff, configured in pyproject.toml), then run the whole suite. Exits non-zero
# on any lint finding, any failure, and when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
.venv/bin/python -m ruff check --quiet .
.venv/bin/python -m pytest -q "$@"
