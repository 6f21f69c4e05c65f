"""Peak memory at the limit a cache allows: the train-dpo process (cached reference) against TRL with a live reference
and our own policy-only run, on a ~115M-parameter model (453 MB of fp32 weights), batch 2, sequence 512.

A cache saves at most the reference's weights: the floor is TRL live's peak RSS minus those bytes. One process per
configuration: `cached` (`python -m dpo.cli --ref-cache` as a user runs it; wait4's ru_maxrss and the run
manifest's memory per phase), `cached_padded` (the same, --batch-layout padded: the like-for-like layout),
`policy` and `trl` (bench_train.py's children). Targets, on cached_padded: within 0.03 of the floor (as fractions of
TRL's peak) and <= 1.02x policy-only.

    .venv/bin/python bench/bench_memory.py [--quick] [--reuse]

--reuse keeps the configurations already in the saved results of the same size and runs only the missing ones.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import bench_train
import common
import train_steps

FULL = dict(model="115M", seq=512, batch=2, warmup=1, steps=1, rounds=1)
QUICK = dict(model="5M", seq=256, batch=2, warmup=1, steps=1, rounds=1)


def run_cli(size: dict, model: Path, data: Path, cache: Path, out: Path, layout: str = "auto") -> dict:
    """train-dpo as a user starts it; the process's own peak RSS (the kernel's, from wait4) and phases."""
    cmd = [sys.executable, "-m", "dpo.cli", "--model", str(model), "--data", str(data), "--ref-cache", str(cache),
           "--output-dir", str(out), "--max-steps", str(size["warmup"] + size["steps"]),
           "--per-device-train-batch-size", str(size["batch"]), "--batch-layout", layout]
    r = common.run_process(cmd, out.parent / "cli.log")
    result = json.loads((out / "run-manifest.json").read_text())["result"]
    return {"mode": f"cached (whole train-dpo process, --batch-layout {layout})", "maxrss_mb": r["maxrss_mb"],
            "wall_s": r["wall_s"], "phases": result["phases"], "batch_layout": result["batch_layout"]}


def main():
    ap = common.parser(__doc__)
    ap.add_argument("--reuse", action="store_true", help="keep the runs already saved (same size), run the others")
    args = ap.parse_args()
    size = QUICK if args.quick else FULL
    log = lambda m: print(m, flush=True)
    saved = common.result_path("memory", args.quick, args.results)
    runs = {}
    if args.reuse and saved.exists() and json.loads(saved.read_text())["size"] == size:
        runs = json.loads(saved.read_text())["runs"]
    with common.workdir("memory") as work:
        model_dir, data, cache, info = train_steps.prepare(size, work)
        params = common.n_params(common.build_llama(size["model"]))
        weights_mb = params * 4 / 2**20
        for mode in ("cached", "cached_padded", "policy", "trl"):
            if mode in runs:
                continue
            t = time.perf_counter()
            if mode.startswith("cached"):
                layout = "padded" if mode == "cached_padded" else "auto"
                runs[mode] = run_cli(size, model_dir, data, cache, work / mode, layout)
            else:
                argv = train_steps.child_argv(bench_train.__file__, size, model_dir, data, cache, work, mode)
                runs[mode] = common.run_child(argv)
            log(f"{mode:<7} peak RSS {runs[mode]['maxrss_mb']:.0f} MiB [{time.perf_counter() - t:.0f} s]")
    c, a, p, t = (runs[m]["maxrss_mb"] for m in ("cached_padded", "cached", "policy", "trl"))
    floor = t - weights_mb
    res = {"size": size, "params": params, "weights_mb": weights_mb, **info, "runs": runs,
           "floor_mb": floor, "mem_cached_vs_trl": c / t, "floor_vs_trl": floor / t,
           "above_floor": c / t - floor / t, "above_floor_mb": c - floor, "mem_cached_vs_policy": c / p,
           "mem_cached_auto_vs_trl": a / t, "mem_cached_auto_vs_policy": a / p}
    log(f"cached (padded) {c:.0f} MiB, cached (auto: {runs['cached']['batch_layout']}) {a:.0f}, policy-only "
        f"(padded) {p:.0f}, TRL live {t:.0f}, floor {floor:.0f} (weights {weights_mb:.0f}): cached/TRL {c / t:.3f}x "
        f"(auto {a / t:.3f}x), floor {floor / t:.3f}x, above the floor {c / t - floor / t:.3f} (target <= 0.03, "
        f"{c - floor:.0f} MiB); cached/policy {c / p:.3f}x (target <= 1.02x; auto {a / p:.3f}x)")
    order = ("startup", "imports", "checks", "verify", "load", "layout", "setup", "train", "save", "plot",
             "final_hash", "manifest")
    for mode in ("cached", "cached_padded"):
        phases = runs[mode]["phases"]
        log(f"train-dpo ({mode}) memory at the end of each phase (RSS / peak so far, MiB): " + ", ".join(
            f"{k} {phases[k].get('rss_mb')}/{phases[k].get('peak_rss_mb')}" for k in order if k in phases))
    for mode in ("policy", "trl"):
        r = runs[mode]
        log(f"{mode}: baseline after imports {r['baseline_rss_mb']:.0f} MiB, at the last step end {r['rss_parts_mb']}")
    print(f"wrote {common.save('memory', res, args)}")


if __name__ == "__main__":
    main()
