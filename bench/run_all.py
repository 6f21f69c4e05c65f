"""Run every part of the bench/ suite, each in a process of its own, and write bench/RESULTS.md.

    .venv/bin/python bench/run_all.py [--quick] [--parts precompute,train,...] [--render-only] [--results DIR]

Each part writes <results>/<part>-<cpu|cuda>.json (bench/results/ by default); RESULTS.md, beside the results
folder, is rendered from whatever JSON is there (render.py), with the CPU and GPU results in sections of their own (a
run on a GPU machine adds the GPU section and keeps the CPU one).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import common
import render

PARTS = {  # part -> script; the default run
    "precompute": "bench_precompute.py",
    "train": "bench_train.py",
    "verify": "bench_verify.py",
    "gather": "bench_gather_memory.py",
    "size": "bench_cache_size.py",
    "scaling": "bench_scaling.py",
    "modes": "bench_modes.py",
}
SCRIPTS = {**PARTS, "sweep": "bench_sweep.py", "memory": "bench_memory.py",  # the whole-job parts: only when named
           "offload": "bench_offload.py", "flops": "bench_flops.py", "flops-jobs": "bench_flops_jobs.py",
           "vocab": "bench_vocab.py",
           "topk": "bench_topk.py", "topk-train": "bench_topk_train.py", "ranks": "bench_ranks.py",
           "compile": "bench_compile.py", "update": "bench_update.py", "store": "bench_store.py",
           "probe": "bench_probe.py", "kl-control": "bench_kl_control.py", "truth-memory": "bench_truth_memory.py",
           "trl-entry": "bench_trl_entry.py"}


def run_parts(parts: list[str], quick: bool, results: Path) -> dict:
    walls = {}
    for part in parts:
        cmd = [sys.executable, str(common.BENCH / SCRIPTS[part]), "--results", str(results)] + (["--quick"] * quick)
        print(f"== {part}: {' '.join(Path(c).name if i < 2 else c for i, c in enumerate(cmd))}", flush=True)
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=common.REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        walls[part] = time.perf_counter() - t
        for line in proc.stdout.splitlines():
            if "Warning" not in line and "warn(" not in line and "USDT:" not in line:
                print("   " + line)
        print(f"   [{part}: {walls[part]:.0f} s, exit {proc.returncode}]", flush=True)
        if proc.returncode:
            walls[part] = None
    return walls


def main():
    ap = common.parser(__doc__)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args()
    if not args.render_only:
        t = time.perf_counter()
        walls = run_parts([p for p in args.parts.split(",") if p], args.quick, args.results)
        run = {"command": " ".join([".venv/bin/python", "bench/run_all.py", *sys.argv[1:]]), "quick": args.quick,
               "walls": walls, "total_s": time.perf_counter() - t, "date": common.machine()["date"]}
        path = common.result_path("run", args.quick, args.results)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run, indent=2) + "\n")
    page = Path(args.results).parent / "RESULTS.md"
    page.write_text(render.render(args.results))
    print(f"wrote {page}")


if __name__ == "__main__":
    main()
