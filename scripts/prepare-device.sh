#!/usr/bin/env bash
# The wheels the device image lacks for the GPU check, into .whl/ (ignored; the device command carries it):
# bench/prepare_device.py downloads bench/device-wheels.txt for CPython 3.12 on x86-64 and checks them and the
# 64 MiB the device tool sends. Arguments go to it (--python-version, --dest). README "GPU check" says what follows.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" bench/prepare_device.py "$@"
