#!/usr/bin/env bash
# The GPU check's device command rehearsed here (issue 39): a fresh clone of this repository's HEAD (what the device
# gets: tracked files; commit first), a venv holding only the device image's packages (bench/device-image.txt) and,
# in the clone, the carried wheels (bench/prepare_device.py), then the exact command README "GPU check" gives for
# the device, with --cpu-smoke, and a look at its results: exit 0 when every row was measured.
#   scripts/rehearse-device.sh [WORKDIR]   # default: a fresh temporary folder, removed when the rehearsal passes
# PYTHON: the venv's interpreter (default python3; the device has CPython 3.12: on another version the wheels are
# fetched for that version too, and the files that differ are named). REHEARSAL_TORCH: the venv's torch requirement
# (default torch==2.13.0, the CPU wheel here: the image's 2.11.0 is a CUDA build in the registry).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
DEVICE_COMMAND='bash bench/gpu_check.sh --results "$OUT"'  # README "GPU check": the same, with carry [".whl"]
work=${1:-$(mktemp -d "${TMPDIR:-/tmp}/refcache-rehearsal-XXXXXX")}
mkdir -p "$work"
py=${PYTHON:-python3}
pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
torch_req=${REHEARSAL_TORCH:-torch==2.13.0}
start=$(date +%s)
say() { echo "rehearsal [$(($(date +%s) - start)) s]: $*"; }
say "in $work; Python $pyver (the device's: 3.12), $torch_req (the device's: 2.11.0+cu130)"

rm -rf "$work/refcache" && git clone -q --no-local "$repo" "$work/refcache"
say "cloned $(git -C "$work/refcache" log -1 --format='%h %s' | cut -c1-80)"

# the image's packages at its versions; torch as said above, numpy 2.5 only from Python 3.12 on
sed -e "s/^torch==[^ ]*/$torch_req/" "$work/refcache/bench/device-image.txt" > "$work/image.txt"
if [ "$pyver" != 3.12 ]; then sed -i -e 's/^numpy==[^ ]*/numpy/' "$work/image.txt"; fi
[ -x "$work/venv/bin/python" ] || "$py" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q -r "$work/image.txt"
if "$work/venv/bin/python" -c "import polars" 2>/dev/null || "$work/venv/bin/python" -c "import datasets" 2>/dev/null; then
    echo "rehearsal: the image venv has polars or datasets: it no longer stands for the device image" >&2
    exit 1
fi
"$work/venv/bin/python" -m pip freeze > "$work/image-freeze.txt"
say "image venv: $(grep -iE '^(torch|transformers|accelerate|numpy|pyarrow|huggingface.hub)=' "$work/image-freeze.txt" | tr '\n' ' ')"

# the wheels, as scripts/prepare-device.sh makes them, for this Python (and, where it is not 3.12, the device's too)
"$work/venv/bin/python" "$work/refcache/bench/prepare_device.py" --python-version "$pyver" --dest "$work/refcache/.whl"
if [ "$pyver" != 3.12 ]; then
    "$work/venv/bin/python" "$work/refcache/bench/prepare_device.py" --python-version 3.12 --dest "$work/whl-3.12"
    say "wheels that differ between CPython $pyver and 3.12: $(diff <(ls "$work/refcache/.whl") <(ls "$work/whl-3.12") | grep '^[<>]' | tr '\n' ' ')"
fi

# the device command, in the clone, with --cpu-smoke; python3 is the venv's, as the image's is there
export OUT="$work/out"
rm -rf "$OUT" && mkdir -p "$OUT"
say "running: $DEVICE_COMMAND --cpu-smoke"
(cd "$work/refcache" && PATH="$work/venv/bin:$PATH" && unset PYTHONPATH VIRTUAL_ENV && eval "$DEVICE_COMMAND --cpu-smoke")
"$work/venv/bin/python" - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
r = json.loads((out / "gpu_check-cpu-quick.json").read_text())
rows = {**{f"precompute {k}": v for k, v in r["precompute"].items() if k == "sdpa"},
        **{f"train {k}": v for k, v in r["train"].items()}}
bad = {k: v.get("error") or v.get("skipped") for k, v in rows.items() if "error" in v or "skipped" in v}
assert r["complete"] and not bad and "vs_fp32" in r["precompute"]["sdpa"], (r["complete"], bad)
print("rehearsal: results complete:", ", ".join(rows), "| polars", r["packages"]["polars"], "datasets",
      r["packages"]["datasets"], "torch", r["packages"]["torch"], "| files:", ", ".join(p.name for p in out.iterdir()))
PY
say "passed"
[ -n "${1:-}" ] || rm -rf "$work"
