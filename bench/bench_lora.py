"""LoRA policies: train-dpo --use-peft step time and peak memory with a cache vs live (adapter-disabled reference) vs
TRL's DPOTrainer with peft, on the same model, data, batch, precision and LoRA config.

  cached   train-dpo --use-peft --ref-cache: the reference is the cache; one forward + backward per step
  live     train-dpo --use-peft --ref-model (= --model): the reference is the policy with its adapter disabled, one
           extra no-grad forward per step, no second model
  trl      trl.DPOTrainer(peft_config=...) with no ref_model: TRL's own adapter-disabled reference

Each configuration runs in a process of its own, round-robin over the rounds so that load from other processes falls
on all alike; the step timer and memory readings are bench_train's (median step time after the warm-up; peak RSS).
LoRA: r 16, alpha 32, dropout 0.05, all linear layers of the blocks (TRL's ModelConfig defaults, refcache's too).

    .venv/bin/python bench/bench_lora.py [--quick]
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import bench_train as bt
import common
from common import torch

QUICK = dict(model="1M", seq=256, batch=8, warmup=1, steps=4, rounds=2)
FULL = dict(model="5M", seq=512, batch=4, warmup=1, steps=4, rounds=2)
GPU = dict(model="350M", seq=1024, batch=8, warmup=3, steps=10, rounds=2)
MODES = ("cached", "live", "trl")
LORA = dict(r=16, alpha=32, dropout=0.05)


def run_ours(a, mode: str, timer, out: str) -> dict:
    from dpo.lora import LoraOptions

    cfg = bt.train_config(a, mode, out)
    cfg.lora = LoraOptions(use_peft=True, lora_r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"])
    return {"verify_s": bt.run_timed(cfg, timer).get("verify_s")}


def run_trl(a, timer, out: str) -> dict:
    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    cuda = torch.cuda.is_available()
    policy = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if cuda else torch.float32,
                                                  use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(a.model)
    rows = [json.loads(line) for line in Path(a.data).read_text().splitlines() if line.strip()]
    ds = datasets.Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    cfg = bt.train_config(a, "trl", out)
    args = DPOConfig(
        output_dir=out, max_length=a.seq, per_device_train_batch_size=a.batch, max_steps=a.warmup + a.steps,
        learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler_type, beta=cfg.beta,
        loss_type=["sigmoid"], optim=cfg.optim, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed, data_seed=cfg.seed, use_cpu=not cuda, bf16=cuda, fp16=False, gradient_checkpointing=False,
        report_to="none", save_strategy="no", logging_steps=1000, disable_tqdm=True, dataloader_pin_memory=cuda,
    )
    peft_config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], bias="none",
                             task_type="CAUSAL_LM", target_modules="all-linear")
    trainer = DPOTrainer(model=policy, args=args, train_dataset=ds, processing_class=tok, peft_config=peft_config,
                         callbacks=[timer])
    trainer.train()
    return {}


def child(a) -> dict:
    common.quiet()
    import datasets, peft, polars, transformers  # noqa: F401,E401  (so the baseline includes the libraries)
    base = common.rss_mb()
    timer = bt.step_timer()
    out = str(Path(a.out) / a.child)
    extra = run_trl(a, timer, out) if a.child == "trl" else run_ours(a, a.child, timer, out)
    return {"mode": a.child, "baseline_rss_mb": base, "maxrss_mb": timer.maxrss_mb, "cuda_peak_mb": timer.cuda_peak_mb,
            "step_s": timer.step_s[a.warmup :], "warmup_s": timer.step_s[: a.warmup],
            "step_peak_rss_mb": timer.step_peak_mb[a.warmup :], "rss_parts_mb": timer.rss_parts_mb, **extra}


def child_args(size, model_dir, data, cache, work, mode) -> list[str]:
    return [__file__, "--child", mode, "--model", str(model_dir), "--data", str(data), "--cache", str(cache),
            "--seq", str(size["seq"]), "--batch", str(size["batch"]), "--warmup", str(size["warmup"]),
            "--steps", str(size["steps"]), "--out", str(work / "runs")]


def main():
    args = common.child_parser(__doc__, MODES).parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    common.quiet()
    dev = common.device()
    size = GPU if dev.type == "cuda" else (QUICK if args.quick else FULL)
    work = common.workdir("lora")
    try:
        model_dir, data, cache, info = bt.prepare(size, work)
        modes = [m for m in MODES if m != "trl" or bt._has_trl()]
        rounds = {m: [] for m in modes}
        for n in range(size["rounds"]):
            for mode in modes:
                t = time.perf_counter()
                rounds[mode].append(common.run_child(child_args(size, model_dir, data, cache, work, mode)))
                r = rounds[mode][-1]
                print(f"round {n} {mode:<7} steps {' '.join(f'{v * 1000:.0f}' for v in r['step_s'])} ms  peak RSS "
                      f"{r['maxrss_mb']:.0f} MiB  load {common.os.getloadavg()[0]:.2f} "
                      f"[{time.perf_counter() - t:.0f} s]", flush=True)
        runs = {m: bt.summarize(v) for m, v in rounds.items()}
        c, lv = runs["cached"], runs["live"]
        res = {"size": size, "lora": LORA, "params": common.n_params(common.build_llama(size["model"])), **info,
               "runs": runs, "ratio_cached_vs_live": common.ratio(c["step"], lv["step"]),
               "saved_fraction_vs_live": 1 - common.ratio(c["step"], lv["step"]),
               "mem_cached_vs_live": c["maxrss_mb"] / lv["maxrss_mb"]}
        if "trl" in runs:
            res["ratio_cached_vs_trl"] = common.ratio(c["step"], runs["trl"]["step"])
            res["ratio_live_vs_trl"] = common.ratio(lv["step"], runs["trl"]["step"])
            res["mem_cached_vs_trl"] = c["maxrss_mb"] / runs["trl"]["maxrss_mb"]
        for mode, r in runs.items():
            print(f"{mode:<7} step {common.fmt_s(r['step'], 'ms', 1000)}  peak RSS {r['maxrss_mb']:.0f} MiB  "
                  f"(steady {r['step_peak']['median']:.0f}, baseline {r['baseline_rss_mb']:.0f})", flush=True)
        print("  ".join(f"{k} {v:.3f}" for k, v in res.items() if k.startswith(("ratio", "mem", "saved"))), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {common.save('lora', res, args.quick)}")


if __name__ == "__main__":
    main()
