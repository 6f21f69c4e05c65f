"""audit-ref's replay (`--model --all`) against precompute-ref on data/ (400 pairs, data/sft-model), round-robin in
this one process:
  precompute  run_precompute end to end, default options, into a fresh output directory
  batched     run_audit(--model --all) on the cache it wrote: every check, the hashes, the model load, the padded
              layout's probe against reference_logps and the replay in padded batches
  sequence    the same with the padded layout refused, every row replayed one sequence at a time (as before
              issue 25, item 13)
Rows/s: pairs per wall second of each call, beside the replay's own `rows_per_s`. Target: batched >= 0.5 x precompute.

    .venv/bin/python bench/bench_audit.py [--quick]
"""

from __future__ import annotations

import contextlib
import shutil
import time

import common
import measure

TARGET = 0.5  # batched audit rows/s over precompute-ref rows/s


@contextlib.contextmanager
def padded_layout_refused():
    """The replay's one-sequence-at-a-time fall-back, forced: shape_dependent names a reason for every model."""
    import runtime.architecture

    kept = runtime.architecture.shape_dependent
    runtime.architecture.shape_dependent = lambda model, longest: "refused by bench_audit.py (the old replay)"
    try:
        yield
    finally:
        runtime.architecture.shape_dependent = kept


def main():
    args = common.parser(__doc__).parse_args()
    common.quiet()
    from audit.cli import run_audit

    reps = 1 if args.quick else 3
    model_dir, data = common.sft_data()
    with common.workdir("audit") as work:
        cache = work / "cache"
        common.precompute(model_dir, data, cache)
        seen = {"precompute": [], "batched": [], "sequence": []}
        replay = {"batched": [], "sequence": []}
        rows = {}

        def precompute():
            out = work / "again"
            shutil.rmtree(out, ignore_errors=True)
            t = time.perf_counter()
            summary = common.precompute(model_dir, data, out)
            seen["precompute"].append(time.perf_counter() - t)
            rows["precompute"] = summary["rows"]

        def audit(kind):
            t = time.perf_counter()
            with padded_layout_refused() if kind == "sequence" else contextlib.nullcontext():
                report = run_audit(cache, model=str(model_dir), sample=None)
            seen[kind].append(time.perf_counter() - t)
            check = next(c for c in report["checks"] if c["name"] == "replay")
            assert report["result"] == "PASS", report["failed"]
            assert (check["info"]["fallback"] is None) == (kind == "batched"), check["info"]
            replay[kind].append(check["info"])
            rows[kind] = check["info"]["rows"]

        precompute(), audit("batched")  # warm-up (imports, first forwards); the sequence arm needs none of its own
        fns = {"precompute": precompute, "batched": lambda: audit("batched"), "sequence": lambda: audit("sequence")}
        measure.interleaved(fns, reps=reps, warmup=0)
        n = {k: len(v) for k, v in seen.items()}
        walls = {k: measure.stats(v[-reps:]) for k, v in seen.items()}  # the timed rounds, not the warm-up
        rate = {k: rows[k] / walls[k]["median"] for k in walls}
        replay_rate = {k: measure.stats([i["rows_per_s"] for i in v[-reps:]])["median"] for k, v in replay.items()}
        result = {
            "rows": rows["precompute"], "reps": reps, "runs": n, "walls_s": walls,
            "rows_per_s": rate, "replay_rows_per_s": replay_rate,
            "layout": replay["batched"][-1]["layout"],
            "batched_over_precompute": rate["batched"] / rate["precompute"],
            "batched_over_sequence": rate["batched"] / rate["sequence"],
            "replay_batched_over_sequence": replay_rate["batched"] / replay_rate["sequence"],
            "target": TARGET, "met": rate["batched"] / rate["precompute"] >= TARGET,
        }
    path = common.save("audit", result, args)
    print(f"{result['rows']} pairs of data/prefs with data/sft-model, {reps} round(s), load {common.LOADAVG_START} "
          f"at start, {common.machine()['loadavg_1min']} at end")
    for k in seen:
        extra = f"; the replay alone {replay_rate[k]:.1f} rows/s" if k in replay_rate else ""
        print(f"  {k:<10} {common.fmt_s(walls[k])}  {rate[k]:.1f} rows/s{extra}")
    print(f"  batched audit / precompute-ref: {result['batched_over_precompute']:.2f}x (target {TARGET}x: "
          f"{'met' if result['met'] else 'not met'}); batched / sequence-at-a-time: "
          f"{result['batched_over_sequence']:.2f}x end to end, {result['replay_batched_over_sequence']:.2f}x the "
          f"replay alone")
    print(f"  layout: {result['layout']}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
