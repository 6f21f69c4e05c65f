"""Run every part of the bench/ suite, each in a process of its own, and write bench/RESULTS.md.

    .venv/bin/python bench/run_all.py [--quick] [--parts precompute,train,...] [--render-only] [--results DIR]

A part is a script bench/bench_<part>.py (`--parts kl-control`: bench_kl_control.py); the default run is PARTS. Each
writes <results>/<part>-<cpu|cuda>.json; RESULTS.md, beside the results folder, is rendered from whatever JSON is
there (render.py), with the CPU and GPU results in sections of their own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import common
import render

SCRIPTS = {p.stem.removeprefix("bench_").replace("_", "-"): p.name  # part -> script: every bench_*.py there is
           for p in sorted(common.BENCH.glob("bench_*.py"))}
PARTS = ("precompute", "train", "verify", "size", "modes")  # the default run; the others only when named


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
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(SCRIPTS)}")
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in SCRIPTS]
    if unknown:
        ap.error(f"no part {', '.join(unknown)}; the parts: {', '.join(SCRIPTS)}")
    if not args.render_only:
        t = time.perf_counter()
        walls = run_parts(parts, args.quick, args.results)
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
