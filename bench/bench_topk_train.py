"""train-dpo's step with the reference's top-k distribution (issue 24): step time and peak memory of

  sigmoid  plain cache (no top-k columns), --loss-type sigmoid: today's step
  kl       top-k cache (K = 32), --loss-type sigmoid: the same loss plus the KL lower-bound metrics
  tdpo2    top-k cache (K = 32), --loss-type tdpo2: the token-level loss on the sequential KL

on the same model, data, batch and precision; target: kl and tdpo2 within 1.10x of sigmoid. One process per
configuration, round-robin, as train_steps measures them; then each is profiled (torch.profiler, 2 steps, a separate
run), and one process times the parts of a step (collate, forward and loss, backward) on one torch thread in CPU
seconds, the configurations interleaved step by step: figures a shared machine barely moves.

    .venv/bin/python bench/bench_topk_train.py [--quick] [--no-profile] [--rounds N]
"""

from __future__ import annotations

import argparse
import json

import common
import measure
import train_steps as steps

QUICK = dict(model="1M", seq=256, batch=8, warmup=1, steps=4, rounds=2)
FULL = dict(model="5M", seq=512, batch=4, warmup=1, steps=6, rounds=3)
GPU = dict(model="350M", seq=1024, batch=8, warmup=3, steps=10, rounds=2)
MODES = ("sigmoid", "kl", "tdpo2")
TOP_K = 32

RUNNERS = {"sigmoid": lambda a, t, o: steps.run_ours(a, "cached", t, o),
           "kl": lambda a, t, o: steps.run_ours(a, "cached", t, o),
           "tdpo2": lambda a, t, o: steps.run_ours(a, "cached", t, o, loss_type="tdpo2")}


def components(a, reps: int) -> dict:
    """CPU seconds of the parts of one step per configuration, one torch thread, in one process, configurations
    interleaved step by step: train-dpo's collator, pair_logps and dpo_loss on its verified rows."""
    import statistics
    import time

    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dpo.layout import PrefixSharedCollator, pair_logps
    from dpo.losses import LossConfig, TopK, dpo_loss
    from dpo.trainer import disable_dropout
    from dpo.verify import verify_and_join

    common.torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=common.torch.float32).train()
    disable_dropout(model)
    rows = {c: datasets.Dataset(verify_and_join(tokenizer=tok, model_dir=a.model, data=a.data, split="train",
                                                cache_dir=c, log=lambda _m: None).table) for c in (a.cache, a.top_k_cache)}
    collate = PrefixSharedCollator(tok.pad_token_id or 0)
    modes = {"sigmoid": (a.cache, LossConfig()), "kl": (a.top_k_cache, LossConfig()),
             "tdpo2": (a.top_k_cache, LossConfig(loss_type="tdpo2"))}
    times = {m: {"collate": [], "forward_loss": [], "backward": []} for m in modes}
    for i in range(reps + 1):  # the first pass is the warm-up
        for mode, (cache, cfg) in modes.items():
            ds = rows[cache]
            t0 = time.process_time()
            batch = collate(ds.__getitems__([(a.batch * i + j) % len(ds) for j in range(a.batch)]))
            t1 = time.process_time()
            top_k = None
            if "ref_top_ids" in batch:
                policy, at_ids, rest = pair_logps(model, batch, given=batch["ref_top_ids"])
                top_k = TopK(at_ids, rest, batch["ref_top_logps"], batch["ref_tail"])
            else:
                policy = pair_logps(model, batch)
            loss, metrics = dpo_loss(policy, batch["ref_logps"], batch["completion_lens"], cfg, top_k)
            common.torch.stack([v.float() for v in metrics.values()], 1).mean(0).tolist()
            t2 = time.process_time()
            loss.backward()
            t3 = time.process_time()
            model.zero_grad(set_to_none=True)
            if i:
                for part, v in zip(times[mode], (t1 - t0, t2 - t1, t3 - t2)):
                    times[mode][part].append(v)
    out = {m: {part: statistics.median(v) for part, v in t.items()} for m, t in times.items()}
    for m, t in out.items():
        t["total"] = sum(t.values())
        t["vs_sigmoid"] = t["total"] / out["sigmoid"]["total"]
    return {"reps": reps, "cpu_s": out}


def main():
    ap = common.child_parser(__doc__, (*MODES, "components"))
    ap.add_argument("--top-k-cache", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)  # a child: profile its steps
    ap.add_argument("--no-profile", action="store_true", help="skip the profiling runs")
    ap.add_argument("--rounds", type=int, help="rounds per configuration (default: the size's)")
    args = ap.parse_args()
    if args.child == "components":
        print(json.dumps(components(args, reps=args.steps)))
        return
    if args.child:
        print(json.dumps(steps.child(args, RUNNERS)))
        return

    common.quiet()
    size = GPU if common.device().type == "cuda" else (QUICK if args.quick else FULL)
    size = {**size, "rounds": args.rounds or size["rounds"]}
    with common.workdir("topk-train") as work:
        model_dir, data, cache, info = steps.prepare(size, work)
        top_k_cache = work / f"cache-top{TOP_K}"
        common.precompute(model_dir, data, top_k_cache, size["seq"], top_k=TOP_K)
        caches = {"sigmoid": cache, "kl": top_k_cache, "tdpo2": top_k_cache}
        argv = lambda mode, size=size, **more: steps.child_argv(__file__, size, model_dir, data, caches[mode], work,
                                                                mode, **more)
        rounds = common.rounds(size["rounds"], MODES, argv, steps.step_line)
        runs = {m: steps.summarize(v) for m, v in rounds.items()}
        base = runs["sigmoid"]
        res = {"size": size, "top_k": TOP_K, "params": common.n_params(common.build_llama(size["model"])), **info,
               "runs": runs, **{f"ratio_{m}_vs_sigmoid": measure.ratio(runs[m]["step"], base["step"])
                                for m in ("kl", "tdpo2")},
               **{f"mem_{m}_vs_sigmoid": runs[m]["maxrss_mb"] / base["maxrss_mb"] for m in ("kl", "tdpo2")}}
        steps.show_runs(runs)
        if not args.no_profile:
            res["profiles"] = {m: common.run_child(argv(m, {**size, "warmup": 1, "steps": 2}, profile=True)).get("profile")
                               for m in MODES}
        res["components"] = common.run_child(steps.child_argv(__file__, {**size, "steps": 8}, model_dir, data, cache,
                                                              work, "components", top_k_cache=top_k_cache))
        print("  ".join(f"{k} {v:.3f}" for k, v in res.items() if k.startswith(("ratio", "mem"))), flush=True)
        print("CPU seconds on one thread: " + "  ".join(f"{m} {t['total']:.3f} ({t['vs_sigmoid']:.3f}x)"
                                                       for m, t in res["components"]["cpu_s"].items()), flush=True)
    print(f"wrote {common.save('topk-train', res, args)}")


if __name__ == "__main__":
    main()
