"""LoRA policies: train-dpo --use-peft step time and peak memory with a cache vs live (adapter-disabled reference) vs
TRL's DPOTrainer with peft, on the same model, data, batch, precision and LoRA config.

  cached   train-dpo --use-peft --ref-cache: the reference is the cache; one forward + backward per step
  live     train-dpo --use-peft --ref-model (= --model): the reference is the policy with its adapter disabled, one
           extra no-grad forward per step, no second model
  trl      trl.DPOTrainer(peft_config=...) with no ref_model: TRL's own adapter-disabled reference

Each configuration runs in a process of its own, round-robin over the rounds so that load from other processes falls
on all alike; step time (median after the warm-up) and peak RSS as bench/train_steps.py measures them.
LoRA: r 16, alpha 32, dropout 0.05, all linear layers of the blocks (TRL's ModelConfig defaults, refcache's too).

    .venv/bin/python bench/bench_lora.py [--quick]
"""

from __future__ import annotations

import json

import common
import measure
import train_steps as steps

QUICK = dict(model="1M", seq=256, batch=8, warmup=1, steps=4, rounds=2)
FULL = dict(model="5M", seq=512, batch=4, warmup=1, steps=4, rounds=2)
GPU = dict(model="350M", seq=1024, batch=8, warmup=3, steps=10, rounds=2)
MODES = ("cached", "live", "trl")
LORA = dict(r=16, alpha=32, dropout=0.05)


def run_ours(a, mode: str, timer, out: str) -> dict:
    from dpo.lora import LoraOptions

    lora = LoraOptions(use_peft=True, lora_r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"])
    return steps.run_ours(a, mode, timer, out, lora=lora)


def run_trl(a, timer, out: str) -> dict:
    from peft import LoraConfig

    peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], bias="none",
                             task_type="CAUSAL_LM", target_modules="all-linear")
    return steps.run_trl(a, timer, out, live_reference=False, trainer={"peft_config": peft_config})


RUNNERS = {"cached": lambda a, t, o: run_ours(a, "cached", t, o), "live": lambda a, t, o: run_ours(a, "live", t, o),
           "trl": run_trl}


def main():
    args = common.child_parser(__doc__, MODES).parse_args()
    if args.child:
        print(json.dumps(steps.child(args, RUNNERS, imports=("peft",))))
        return

    common.quiet()
    dev = common.device()
    size = GPU if dev.type == "cuda" else (QUICK if args.quick else FULL)
    with common.workdir("lora") as work:
        model_dir, data, cache, info = steps.prepare(size, work)
        modes = [m for m in MODES if m != "trl" or common.has_trl()]
        rounds = common.rounds(size["rounds"], modes, lambda m: steps.child_argv(__file__, size, model_dir, data,
                                                                                 cache, work, m), steps.step_line)
        runs = {m: steps.summarize(v) for m, v in rounds.items()}
        c, lv = runs["cached"], runs["live"]
        res = {"size": size, "lora": LORA, "params": common.n_params(common.build_llama(size["model"])), **info,
               "runs": runs, "ratio_cached_vs_live": measure.ratio(c["step"], lv["step"]),
               "saved_fraction_vs_live": 1 - measure.ratio(c["step"], lv["step"]),
               "mem_cached_vs_live": c["maxrss_mb"] / lv["maxrss_mb"]}
        if "trl" in runs:
            res["ratio_cached_vs_trl"] = measure.ratio(c["step"], runs["trl"]["step"])
            res["ratio_live_vs_trl"] = measure.ratio(lv["step"], runs["trl"]["step"])
            res["mem_cached_vs_trl"] = c["maxrss_mb"] / runs["trl"]["maxrss_mb"]
        steps.show_runs(runs)
        print("  ".join(f"{k} {v:.3f}" for k, v in res.items() if k.startswith(("ratio", "mem", "saved"))), flush=True)
    print(f"wrote {common.save('lora', res, args)}")


if __name__ == "__main__":
    main()
