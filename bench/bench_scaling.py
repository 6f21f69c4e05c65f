"""Part 6: precompute-ref wall time for 1x, 2x and 4x the pairs (it should be linear: fixed cost + per pair).

run_precompute end to end on synthetic pairs, the three sizes timed round-robin (median of reps after a warm-up),
then a least-squares line wall = fixed + per_pair * pairs through the medians.

    .venv/bin/python bench/bench_scaling.py [--quick]
"""

from __future__ import annotations

import shutil

import common
import measure
import numpy as np

QUICK = dict(model="1M", seq=128, pairs=64, reps=3)
FULL = dict(model="5M", seq=512, pairs=24, reps=3)
GPU = dict(model="35M", seq=512, pairs=512, reps=3)


def main():
    args = common.parser(__doc__).parse_args()
    common.quiet()
    dev = common.device()
    size = GPU if dev.type == "cuda" else (QUICK if args.quick else FULL)
    with common.workdir("scaling") as work:
        model_dir = common.make_checkpoint(work, size["model"])
        vocab = common.MODELS[size["model"]]["vocab"]
        rows = common.synthetic_pairs(4 * size["pairs"], size["seq"], vocab, seed=4)
        last, fns = {}, {}
        for k in (1, 2, 4):
            data = common.write_jsonl(work / f"data-{k}x" / "train.jsonl", rows[: k * size["pairs"]])
            out = work / f"cache-{k}x"

            def fn(k=k, data=data, out=out):
                shutil.rmtree(out, ignore_errors=True)
                last[k] = common.precompute(model_dir, data, out, size["seq"])
            fns[f"{k}x"] = fn
        times = measure.interleaved(fns, reps=size["reps"], warmup=1)
    pairs = np.array([k * size["pairs"] for k in (1, 2, 4)], float)
    wall = np.array([times[f"{k}x"]["median"] for k in (1, 2, 4)])
    per_pair, fixed = np.polyfit(pairs, wall, 1)
    pred = fixed + per_pair * pairs
    r2 = 1 - ((wall - pred) ** 2).sum() / ((wall - wall.mean()) ** 2).sum()
    points = [{"scale": f"{k}x", "pairs": int(p), "tokens": last[k]["tokens"], "wall": times[f"{k}x"],
               "tokens_per_s": last[k]["tokens"] / times[f"{k}x"]["median"]} for k, p in zip((1, 2, 4), pairs)]
    for p in points:
        print(f"{p['scale']}: {p['pairs']:>5} pairs {p['tokens']:>8} tok  wall {common.fmt_s(p['wall'])}  "
              f"{p['tokens_per_s']:,.0f} tok/s")
    res = {"size": size, "points": points, "fixed_s": fixed, "per_pair_s": per_pair, "r2": r2,
           "wall_4x_over_1x": wall[2] / wall[0], "wall_2x_over_1x": wall[1] / wall[0]}
    print(f"fit: {fixed:.2f} s fixed + {per_pair * 1000:.1f} ms/pair (R^2 {r2:.4f}); 4x/1x wall "
          f"{res['wall_4x_over_1x']:.2f}")
    print(f"wrote {common.save('scaling', res, args)}")


if __name__ == "__main__":
    main()
