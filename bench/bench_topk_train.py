"""train-dpo's step with the reference's top-k distribution (issue 24): step time and peak memory of

  sigmoid  plain cache (no top-k columns), --loss-type sigmoid: today's step
  kl       top-k cache (K = 32), --loss-type sigmoid: the same loss plus the KL lower-bound metrics (the policy's
           log-probs of the reference's K ids and its tail, from the same forward)
  tdpo2    top-k cache (K = 32), --loss-type tdpo2: the token-level loss on the sequential KL

on the same model, data, batch and precision; target: kl and tdpo2 within 1.10x of sigmoid. Each configuration runs
in a process of its own, round-robin over the rounds; step time (median after the warm-up) and peak RSS as
bench/train_steps.py measures them. Then each configuration is profiled (torch.profiler, 2 steps after the warm-up,
a separate run: the profiler slows steps); the tables land in the results and bench/RESULTS.md.

    .venv/bin/python bench/bench_topk_train.py [--quick] [--no-profile]
"""

from __future__ import annotations

import argparse
import json

import common
import train_steps as steps

QUICK = dict(model="1M", seq=256, batch=8, warmup=1, steps=4, rounds=2)
FULL = dict(model="5M", seq=512, batch=4, warmup=1, steps=6, rounds=3)
GPU = dict(model="350M", seq=1024, batch=8, warmup=3, steps=10, rounds=2)
MODES = ("sigmoid", "kl", "tdpo2")
TOP_K = 32

RUNNERS = {"sigmoid": lambda a, t, o: steps.run_ours(a, "cached", t, o),
           "kl": lambda a, t, o: steps.run_ours(a, "cached", t, o),
           "tdpo2": lambda a, t, o: steps.run_ours(a, "cached", t, o, loss_type="tdpo2")}


def child_argv(size, model_dir, data, cache, work, mode, profile=False) -> list[str]:
    return steps.child_argv(__file__, size, model_dir, data, cache, work, mode) + (["--profile"] if profile else [])


def main():
    ap = common.child_parser(__doc__, MODES)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)  # a child: profile its steps
    ap.add_argument("--no-profile", action="store_true", help="skip the profiling runs")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(steps.child(args, RUNNERS)))
        return

    common.quiet()
    size = GPU if common.device().type == "cuda" else (QUICK if args.quick else FULL)
    with common.workdir("topk-train") as work:
        model_dir, data, cache, info = steps.prepare(size, work)
        top_k_cache = work / f"cache-top{TOP_K}"
        common.precompute(model_dir, data, top_k_cache, size["seq"], top_k=TOP_K)
        caches = {"sigmoid": cache, "kl": top_k_cache, "tdpo2": top_k_cache}
        rounds = common.rounds(size["rounds"], MODES, lambda m: child_argv(size, model_dir, data, caches[m], work, m),
                               steps.step_line)
        runs = {m: steps.summarize(v) for m, v in rounds.items()}
        base = runs["sigmoid"]
        res = {"size": size, "top_k": TOP_K, "params": common.n_params(common.build_llama(size["model"])), **info,
               "runs": runs, **{f"ratio_{m}_vs_sigmoid": common.ratio(runs[m]["step"], base["step"])
                                for m in ("kl", "tdpo2")},
               **{f"mem_{m}_vs_sigmoid": runs[m]["maxrss_mb"] / base["maxrss_mb"] for m in ("kl", "tdpo2")}}
        steps.show_runs(runs)
        if not args.no_profile:
            prof_size = {**size, "warmup": 1, "steps": 2}
            res["profiles"] = {m: common.run_child(child_argv(prof_size, model_dir, data, caches[m], work, m,
                                                              profile=True)).get("profile") for m in MODES}
        print("  ".join(f"{k} {v:.3f}" for k, v in res.items() if k.startswith(("ratio", "mem"))), flush=True)
    print(f"wrote {common.save('topk-train', res, args)}")


if __name__ == "__main__":
    main()
