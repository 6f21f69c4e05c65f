"""Part 10: precompute-ref with the reference split by --device-map auto (accelerate's dispatch) against the whole
model in memory: what disk offload costs. run_precompute end to end, round-robin: `in-memory` (the default), `fits`
(--device-map auto with room for the whole model: the cost of asking) and `offload` (--max-memory half the weights:
the rest read from disk at every forward); the caches compared value by value against in-memory.

    .venv/bin/python bench/bench_offload.py [--quick]
"""

from __future__ import annotations

import shutil

import common
import measure

QUICK = dict(model="1M", seq=128, pairs=32, reps=3)
FULL = dict(model="5M", seq=512, pairs=32, reps=3)
GPU = dict(model="35M", seq=512, pairs=256, reps=3)  # a GPU budget would be 0=SIZE; here the split is CPU and disk


def main():
    args = common.parser(__doc__).parse_args()
    common.quiet()
    dev = common.device()
    size = GPU if dev.type == "cuda" else (QUICK if args.quick else FULL)
    with common.workdir("offload") as work:
        model_dir, data = common.synthetic_case(work, size["model"], size["pairs"], size["seq"], seed=6)
        weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
        ways = {"in-memory": {}, "fits": dict(device_map="auto", max_memory=str(4 * weights)),
                "offload": dict(device_map="auto", max_memory=str(weights // 2), offload_folder=str(work / "off"))}
        last, fns = {}, {}
        for name, options in ways.items():
            out = work / f"cache-{name}"

            def fn(name=name, options=options, out=out):
                shutil.rmtree(out, ignore_errors=True)
                last[name] = common.precompute(model_dir, data, out, size["seq"], device="auto", **options)
            fns[name] = fn
        times = measure.interleaved(fns, reps=size["reps"], warmup=1)
        from schemas import format as fmt

        diff = {n: common.max_abs_diff(work / f"cache-{n}", work / "cache-in-memory") for n in ways}
        layout = fmt.read_manifest(work / "cache-offload")["computation"].get("layout")
    ratio = {n: measure.ratio(times[n], times["in-memory"]) for n in ways}
    for n in ways:
        print(f"{n:>9}: wall {common.fmt_s(times[n])}  {last[n]['tokens'] / times[n]['median']:,.0f} tok/s  "
              f"x{ratio[n]:.2f} of in-memory  max abs diff {diff[n]:.1e}")
    print(f"offload layout: {layout}")
    res = {"size": {**size, "weights_bytes": weights}, "wall": times, "ratio_vs_in_memory": ratio,
           "max_abs_diff_vs_in_memory": diff, "tokens": last["in-memory"]["tokens"], "layout": layout,
           "mode": {n: last[n]["mode"] for n in ways}}
    print(f"wrote {common.save('offload', res, args)}")


if __name__ == "__main__":
    main()
