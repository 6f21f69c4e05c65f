"""train-dpo's step under KL governance (issue 35) against a fixed β, on the same top-k cache (K = 32):

  sigmoid   --loss-type sigmoid, fixed --beta: the plain step (the KL metrics of the top-k cache are logged too)
  governed  the same plus --kl-target LO:HI (a band below the run's KL, so β moves at every step) and
            --kl-alarm LEVEL:warn (checked at every logged step, never fires)

Both log every step. One process per configuration, round-robin over the rounds; step time as train_steps measures
it, and the ratio governed / sigmoid (target <= 1.02x); beside it the ratio in the process's CPU seconds per step,
and the governor's own share: its hooks' CPU seconds (KLGovernor) per step over the plain step's CPU seconds.

    .venv/bin/python bench/bench_kl_control.py [--quick] [--rounds N]
"""

from __future__ import annotations

import json
import time

import common
import measure
import train_steps as steps

QUICK = dict(model="1M", seq=256, batch=8, warmup=1, steps=6, rounds=2)
FULL = dict(model="5M", seq=512, batch=4, warmup=1, steps=8, rounds=3)
GPU = dict(model="350M", seq=1024, batch=8, warmup=3, steps=10, rounds=2)
MODES = ("sigmoid", "governed")
TOP_K = 32
LOGGED = dict(logging_steps=1)
GOVERNED = dict(kl_target="1e-9:2e-9", kl_adapt_every=1, beta_max=10.0, kl_alarm="100:warn")



HOOKS = ("on_step_begin", "on_step_end", "observe", "extras")


def timing_governor(spent: list) -> None:
    """Add the thread's CPU seconds in each of KLGovernor's hooks to spent[0]."""
    from dpo.kl_governor import KLGovernor

    def timed(hook):
        def run(*args, **kw):
            t = time.thread_time()
            try:
                return hook(*args, **kw)
            finally:
                spent[0] += time.thread_time() - t
        return run

    for name in HOOKS:
        setattr(KLGovernor, name, timed(getattr(KLGovernor, name)))


def with_cpu_seconds(a, timer, out, **overrides) -> dict:
    """run_ours, the timer also reading the process's CPU seconds between the same callbacks as its wall time, and
    the governor's hooks' CPU seconds in each step (it runs before the timer at the step's end)."""
    cpu, begin, end = [time.process_time()], timer.on_train_begin, timer.on_step_end
    spent, per_step = [0.0], []
    timing_governor(spent)

    def on_train_begin(*args, **kw):
        cpu[:] = [time.process_time()]
        return begin(*args, **kw)

    def on_step_end(*args, **kw):
        end(*args, **kw)
        cpu.append(time.process_time())
        per_step.append(spent[0])
        spent[0] = 0.0

    timer.on_train_begin, timer.on_step_end = on_train_begin, on_step_end
    extra = steps.run_ours(a, "cached", timer, out, **LOGGED, **overrides)
    return {**extra, "cpu_step_s": [b - x for x, b in zip(cpu, cpu[1:])][a.warmup :],
            "governor_step_s": per_step[a.warmup :]}


RUNNERS = {"sigmoid": lambda a, t, o: with_cpu_seconds(a, t, o),
           "governed": lambda a, t, o: with_cpu_seconds(a, t, o, **GOVERNED)}


def main():
    ap = common.child_parser(__doc__, MODES)
    ap.add_argument("--rounds", type=int, help="rounds per configuration (default: the size's)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(steps.child(args, RUNNERS)))
        return

    common.quiet()
    size = GPU if common.device().type == "cuda" else (QUICK if args.quick else FULL)
    size = {**size, "rounds": args.rounds or size["rounds"]}
    with common.workdir("kl-control") as work:
        model_dir, data, _, info = steps.prepare(size, work)
        cache = work / f"cache-top{TOP_K}"
        common.precompute(model_dir, data, cache, size["seq"], top_k=TOP_K)
        rounds = common.rounds(size["rounds"], MODES,
                               lambda m: steps.child_argv(__file__, size, model_dir, data, cache, work, m),
                               steps.step_line)
    runs = {m: steps.summarize(v) for m, v in rounds.items()}
    for mode, r in runs.items():
        for key in ("cpu_step", "governor_step"):
            r[key] = measure.stats([v for one in rounds[mode] for v in one[f"{key}_s"]])
    base, governed = runs["sigmoid"], runs["governed"]
    res = {"size": size, "top_k": TOP_K, "governed": GOVERNED, **info, "runs": runs,
           "ratio_governed_vs_sigmoid": measure.ratio(governed["step"], base["step"]),
           "ratio_best_governed_vs_sigmoid": governed["step"]["min"] / base["step"]["min"],
           "ratio_cpu_governed_vs_sigmoid": measure.ratio(governed["cpu_step"], base["cpu_step"]),
           "governor_share_of_step": measure.ratio(governed["governor_step"], base["cpu_step"])}
    steps.show_runs(runs)
    print("  ".join(f"{m} CPU {common.fmt_s(r['cpu_step'], 'ms', 1000)}" for m, r in runs.items()))
    print(f"governed / sigmoid: {res['ratio_governed_vs_sigmoid']:.3f}x (median steps), "
          f"{res['ratio_best_governed_vs_sigmoid']:.3f}x (best steps), {res['ratio_cpu_governed_vs_sigmoid']:.3f}x "
          "(median CPU seconds per step); target <= 1.02x", flush=True)
    print(f"governor hooks: {common.fmt_s(governed['governor_step'], 'ms', 1000)} CPU per step, "
          f"{res['governor_share_of_step']:.4%} of a plain step's CPU seconds", flush=True)
    print(f"wrote {common.save('kl-control', res, args)}")


if __name__ == "__main__":
    main()
