#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py; its docstring says what it measures) from any directory, stopped at
# GPU_CHECK_LIMIT seconds (default 480, the 8 minutes it is sized for). Arguments go to the script, e.g. --cpu-smoke
# or --results DIR; with --results DIR the output is also written to DIR/gpu_check.log. PYTHON: the interpreter
# (default .venv/bin/python if there, else python3: on the device, the image's).
# Where this interpreter lacks polars or datasets and .whl/ holds wheels (bench/prepare_device.py made them; the
# device tool carries them), they are installed first into a fresh folder put first on PYTHONPATH and checked
# (bench/prepare_device.py --check), before the limit starts. README "GPU check" gives the device command.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
log=/dev/null
args=("$@")
for i in "${!args[@]}"; do
    [ "${args[$i]}" = --results ] && [ $((i + 1)) -lt ${#args[@]} ] && log="${args[$((i + 1))]}/gpu_check.log"
done
[ "$log" = /dev/null ] || mkdir -p "$(dirname "$log")"
{
    site=
    trap '[ -z "$site" ] || rm -rf "$site"' EXIT  # here: the group runs in a subshell of the pipe
    if ! "$python" -c "import polars, datasets" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
        site=$(mktemp -d "${TMPDIR:-/tmp}/refcache-site-XXXXXX")
        echo "installing the carried wheels (.whl/) into $site"
        PIP_ROOT_USER_ACTION=ignore "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        "$python" bench/prepare_device.py --check
    fi
    export GPU_CHECK_LIMIT=${GPU_CHECK_LIMIT:-480} PYTHONUNBUFFERED=1
    export GPU_CHECK_DEADLINE=$(($(date +%s) + GPU_CHECK_LIMIT))
    timeout --signal INT --kill-after 30 "$GPU_CHECK_LIMIT" "$python" bench/gpu_check.py "$@"
} 2>&1 | tee "$log"
