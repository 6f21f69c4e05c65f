"""TRL's own DPOTrainer over bench_sweep.py's 3-beta sweep, each beta a process running bench/sweep_trl.py, as
`trl+cache` (`from dpo.trl import DPOTrainer` with `ref_cache=` one cache precompute-ref made once, timed) and `trl`
(`precompute_ref_log_probs=True`: its reference log-probs in every run). Per process: wall, CPU seconds and peak RSS
(common.run_process), interleaved per beta.

    .venv/bin/python bench/bench_trl_entry.py [--quick]
"""

from __future__ import annotations

from pathlib import Path

import common
from bench_sweep import FULL, QUICK, precompute, run_trl


def sweep(size: dict, work: Path, log) -> dict:
    model, data = common.synthetic_case(work, size["model"], size["pairs"], size["seq"], seed=3)
    cache = work / "cache"
    pre = precompute(size, model, data, cache, log)
    ours, trl = [], []
    for beta in size["betas"]:
        log(f"beta {beta}: TRL with the cache, then TRL's own precompute")
        ours.append(run_trl(size, model, data, work / f"cache-{beta}", beta, log, cache))
        trl.append(run_trl(size, model, data, work / f"trl-{beta}", beta, log))
    total = {"trl+cache": pre["wall_s"] + sum(r["wall_s"] for r in ours), "trl": sum(r["wall_s"] for r in trl)}
    return {"precompute": pre, "trl+cache": ours, "trl": trl, "total_wall_s": total,
            "ratio_wall": total["trl+cache"] / total["trl"],
            "peak_rss_mb": {"trl+cache": max(r["maxrss_mb"] for r in ours), "trl": max(r["maxrss_mb"] for r in trl),
                            "precompute": pre["maxrss_mb"]},
            "loss_difference": max(abs(a["train_loss"] - b["train_loss"]) for a, b in zip(ours, trl))}


def main():
    args = common.parser(__doc__).parse_args()
    size = QUICK if args.quick else FULL
    log = lambda m: print(m, flush=True)
    with common.workdir("trl-entry") as work:
        res = sweep(size, work, log)
    log(f"total wall: TRL + cache {res['total_wall_s']['trl+cache']:.1f} s (precompute "
        f"{res['precompute']['wall_s']:.1f} s + 3 runs), TRL precompute {res['total_wall_s']['trl']:.1f} s -> "
        f"{res['ratio_wall']:.3f}x; peak RSS {res['peak_rss_mb']}; train_loss differs by at most "
        f"{res['loss_difference']:.2g}")
    for side in ("trl+cache", "trl"):
        for r in res[side]:
            log(f"  {side:<9} wall {r['wall_s']:.1f} s (setup {r['setup_s']:.1f} s, loop {r['loop_s']:.1f} s), "
                f"peak RSS {r['maxrss_mb']:.0f} MB, load {r['loadavg'][0]:.2f} -> {r['loadavg'][1]:.2f}")
    res["size"] = size
    print(f"wrote {common.save('trl-entry', res, args)}")


if __name__ == "__main__":
    main()
