"""Part "update" (named only): precompute-ref --update adding 10% rows to a cache, against a full precompute-ref of the
grown data and a fresh precompute of the new rows alone (the update's floor), run_precompute end to end, round-robin
after a warm-up (the first 90.9% rows' cache copied back before each update, untimed). The updated cache is compared
value by value with the full one. Target: update <= 0.2x the full precompute's wall time.

    .venv/bin/python bench/bench_update.py [--quick]
"""

from __future__ import annotations

import shutil
import time

import common
import measure

QUICK = dict(model="1M", seq=128, pairs=200, added=20, rows_per_shard=50, reps=3)
FULL = dict(model="5M", seq=256, pairs=400, added=40, rows_per_shard=100, reps=3)
GPU = dict(model="35M", seq=512, pairs=4000, added=400, rows_per_shard=500, reps=3)


def main():
    args = common.parser(__doc__).parse_args()
    common.quiet()
    dev = common.device()
    size = GPU if dev.type == "cuda" else (QUICK if args.quick else FULL)
    with common.workdir("update") as work:
        model_dir, _ = common.synthetic_case(work, size["model"], 1, size["seq"], seed=8)
        rows = common.synthetic_pairs(size["pairs"] + size["added"], size["seq"], common.MODELS[size["model"]]["vocab"],
                                      seed=8)
        old = common.write_jsonl(work / "v1" / "train.jsonl", rows[:size["pairs"]])
        grown = common.write_jsonl(work / "v2" / "train.jsonl", rows)
        new = common.write_jsonl(work / "new" / "train.jsonl", rows[size["pairs"]:])
        options = dict(rows_per_shard=size["rows_per_shard"], device="auto")
        base = work / "cache-v1"
        common.precompute(model_dir, old, base, size["seq"], **options)
        last = {}

        def full():
            shutil.rmtree(work / "full", ignore_errors=True)
            return common.precompute(model_dir, grown, work / "full", size["seq"], **options)

        def update():
            return common.precompute(model_dir, grown, work / "updated", size["seq"], update=True, **options)

        def new_only():
            shutil.rmtree(work / "new-only", ignore_errors=True)
            return common.precompute(model_dir, new, work / "new-only", size["seq"], **options)

        def fresh_base():
            shutil.rmtree(work / "updated", ignore_errors=True)
            shutil.copytree(base, work / "updated")

        ways = {"full": (full, None), "update": (update, fresh_base), "new rows only": (new_only, None)}
        times = {n: [] for n in ways}
        for rep in range(1 + size["reps"]):  # the first round is the warm-up
            for name, (fn, setup) in ways.items():
                if setup:
                    setup()
                common.sync()
                t = time.perf_counter()
                last[name] = fn()
                common.sync()
                if rep:
                    times[name].append(time.perf_counter() - t)
        times = {n: measure.stats(v) for n, v in times.items()}
        diff = common.max_abs_diff(work / "updated", work / "full")
    ratio = {n: measure.ratio(times[n], times["full"]) for n in ways}
    for n in ways:
        print(f"{n:>14}: wall {common.fmt_s(times[n])}  scored {last[n]['rows_scored']} of {last[n]['rows']} rows  "
              f"x{ratio[n]:.3f} of the full precompute")
    print(f"updated vs full cache: max abs diff per token {diff:.1e}")
    res = {"size": size, "wall": times, "ratio_vs_full": ratio, "max_abs_diff_vs_full": diff,
           "rows_scored": {n: last[n]["rows_scored"] for n in ways}, "rows": {n: last[n]["rows"] for n in ways},
           "mode": {n: last[n]["mode"] for n in ways}, "target": 0.2}
    print(f"wrote {common.save('update', res, args)}")


if __name__ == "__main__":
    main()
