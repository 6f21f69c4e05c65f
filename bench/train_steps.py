"""The training-step harness of the parts that time train-dpo steps (no measurement of its own).

Each configuration trains in a child process of its own (`--child MODE`): `child` runs the part's runner with a step
timer in the Trainer and returns the step times after the warm-up (the interval between on_step_end callbacks:
collation, forward, backward, optimizer) and the memory: peak RSS to the end of the last step (on CUDA also
torch.cuda.max_memory_allocated) and the steady per-step peak (VmHWM reset at every step end). The parent prepares
one model, data set and cache (`prepare`), runs the configurations round-robin and pools their rounds (`summarize`).
`run_ours` is train-dpo's entry point (dpo.recipe.run_train); `run_trl` is trl.DPOTrainer on the same rows, sizes,
precision and hyperparameters.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import common
import measure
from common import torch


def step_timer(profile=None, profile_after: int = 0):
    """A TrainerCallback timing each step and its peak RSS; with `profile`, profiles steps after `profile_after`."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.step_s, self.step_peak_mb, self.step_cuda_mb, self.last = [], [], [], None
            self.maxrss_mb = self.cuda_peak_mb = self.rss_parts_mb = None
            self.profiling = False

        def on_train_begin(self, args, state, control, **kw):
            common.sync()
            measure.reset_peak()
            self.last = time.perf_counter()

        def on_train_end(self, args, state, control, **kw):
            if self.profiling:
                profile.__exit__(None, None, None)
                self.profiling = False

        def on_step_end(self, args, state, control, **kw):
            common.sync()
            now = time.perf_counter()
            self.step_s.append(now - self.last)
            self.step_peak_mb.append(measure.peak_rss_mb())
            self.step_cuda_mb.append(measure.cuda_peak_mb())
            self.last = now
            # the whole-run peaks, read before the next step resets the counters
            self.maxrss_mb = measure.maxrss_mb()
            self.rss_parts_mb = measure.rss_parts_mb()  # at the end of the step
            self.cuda_peak_mb = max(self.cuda_peak_mb or 0, self.step_cuda_mb[-1] or 0) or None
            if profile is not None and state.global_step == profile_after:
                profile.__enter__()
                self.profiling = True
            measure.reset_peak()

    return StepTimer()


def train_config(a, mode: str, out: str, **overrides):
    """train-dpo's TrainConfig for a child's options: cached reads a.cache, live uses the model as reference."""
    from dpo.config import TrainConfig

    cuda = torch.cuda.is_available()
    options = dict(
        model=a.model, data=a.data, output_dir=out, ref_cache=a.cache if mode == "cached" else None,
        ref_model=a.model if mode == "live" else None, max_length=a.seq, max_steps=a.warmup + a.steps,
        per_device_train_batch_size=a.batch, logging_steps=1000, save_strategy="no", plot=False,
        use_cpu=not cuda, bf16=cuda, report_to="none", eval_on_start=False,
        overwrite_output_dir=True,  # each timed round trains again into the same scratch folder
    )
    return TrainConfig(**{**options, **overrides})


def run_timed(cfg, timer, log=lambda m: None) -> dict:
    """The real train-dpo entry point (dpo.recipe.run_train) on `cfg`, with the step timer added to its Trainer."""
    from dpo import trainer as T
    from dpo.recipe import run_train

    orig = T.DPOTrainer.__init__

    def init(self, *args, **kw):
        kw["callbacks"] = [*(kw.get("callbacks") or []), timer]
        orig(self, *args, **kw)

    T.DPOTrainer.__init__ = init
    try:
        return run_train(cfg, log=log)
    finally:
        T.DPOTrainer.__init__ = orig


def run_ours(a, mode: str, timer, out: str, **overrides) -> dict:
    """cached or live: train-dpo's run_train, with the step timer added to its Trainer."""
    logs = []
    res = run_timed(train_config(a, mode, out, **overrides), timer, log=logs.append)
    return {"verify_s": res.get("verify_s"), "log": [m for m in logs if m.startswith("batch layout")]}


def run_trl(a, timer, out: str, live_reference: bool = True, data: str | None = None, trainer=None, **overrides):
    """trl.DPOTrainer on the rows of `data` (default a.data), with the hyperparameters of train_config's run (and
    `overrides` of its DPOConfig); a live reference model unless `live_reference` is False; `trainer` adds keyword
    arguments to DPOTrainer (peft_config)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    cfg, cuda = train_config(a, "trl", out), torch.cuda.is_available()
    options = dict(
        output_dir=out, max_length=a.seq, per_device_train_batch_size=a.batch, max_steps=a.warmup + a.steps,
        learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler_type, beta=cfg.beta,
        loss_type=["sigmoid"], optim=cfg.optim, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed, data_seed=cfg.seed, use_cpu=not cuda, bf16=cuda, fp16=False, gradient_checkpointing=False,
        report_to="none", save_strategy="no", logging_steps=1000, disable_tqdm=True, dataloader_pin_memory=cuda,
    )
    if options["optim"] is None:  # train-dpo's default: the Trainer's own, which DPOConfig has too
        del options["optim"]
    args = DPOConfig(**{**options, **overrides})
    load = lambda: AutoModelForCausalLM.from_pretrained(
        a.model, dtype=torch.bfloat16 if args.bf16 else torch.float32, use_safetensors=True)
    policy, ref = load(), load() if live_reference else None
    rows = [json.loads(line) for line in Path(data or a.data).read_text().splitlines() if line.strip()]
    ds = datasets.Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=ds, processing_class=AutoTokenizer.from_pretrained(
        a.model), callbacks=[timer], **(trainer or {})).train()
    return {}


def child(a, runners: dict, imports=(), report_errors: bool = False) -> dict:
    """One configuration: runners[a.child](a, timer, out) -> extra fields of the result. With report_errors, an
    exception is the result ({"error": ...}; e.g. TRL's padding_free without flash attention), not a failure."""
    import importlib

    common.quiet()
    for name in ("datasets", "polars", "transformers", *imports):  # so that the baseline includes the libraries
        importlib.import_module(name)
    base = measure.rss_mb()
    profile = None
    if getattr(a, "profile", False):
        from torch.profiler import ProfilerActivity, profile as torch_profile

        profile = torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                                                     if torch.cuda.is_available() else []))
    timer = step_timer(profile, a.warmup)
    try:
        extra = runners[a.child](a, timer, str(Path(a.out) / a.child))
    except Exception as e:
        if not report_errors:
            raise
        return {"mode": a.child, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    r = {"mode": a.child, "baseline_rss_mb": base, "maxrss_mb": timer.maxrss_mb, "cuda_peak_mb": timer.cuda_peak_mb,
         "step_s": timer.step_s[a.warmup :], "warmup_s": timer.step_s[: a.warmup],
         "step_peak_rss_mb": timer.step_peak_mb[a.warmup :], "rss_parts_mb": timer.rss_parts_mb, **extra}
    if profile is not None:
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        r["profile"] = profile.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=48)
    return r


def child_argv(script: str, size: dict, model_dir, data, cache, work: Path, mode: str, profile: bool = False,
               **more) -> list[str]:
    """The argv of one configuration's child; `profile`: it profiles its steps (the part's --profile flag)."""
    return common.child_argv(script, mode, model=model_dir, data=data, cache=cache, seq=size.get("seq"),
                             batch=size["batch"], warmup=size["warmup"], steps=size["steps"], out=work / "runs",
                             **more) + ["--profile"] * profile


def step_line(r: dict) -> str:
    """A child's result in one line of the parent's log."""
    return r.get("error") or (f"steps {' '.join(f'{v * 1000:.0f}' for v in r['step_s'])} ms  peak RSS "
                              f"{r['maxrss_mb']:.0f} MiB {' '.join(r.get('log') or [])}")


def prepare(size: dict, work: Path):
    """A checkpoint of size["model"], synthetic pairs for one epoch of every step, and their cache."""
    pairs = size["batch"] * (size["warmup"] + size["steps"])  # one epoch covers every step
    model_dir, data = common.synthetic_case(work, size["model"], pairs, size["seq"], seed=2)
    cache = work / "cache"
    t = time.perf_counter()
    res = common.precompute(model_dir, data, cache, size["seq"])
    return model_dir, data, cache, {"pairs": pairs, "precompute_s": time.perf_counter() - t, "tokens": res["tokens"],
                                    "padding_fraction": res["padding_fraction"]}


def summarize(rounds: list[dict]) -> dict:
    """Pool the rounds of one configuration (or keep its error)."""
    if "error" in rounds[0]:
        return {"error": rounds[0]["error"]}
    pooled = lambda key: [v for r in rounds for v in r[key]]
    median = lambda key: common.statistics.median(r[key] for r in rounds)
    out = {"mode": rounds[0]["mode"], "rounds": rounds,
           "step": measure.stats(pooled("step_s")), "step_peak": measure.stats(pooled("step_peak_rss_mb")),
           "maxrss": measure.stats([r["maxrss_mb"] for r in rounds]), "baseline_rss_mb": median("baseline_rss_mb")}
    out["maxrss_mb"] = out["maxrss"]["median"]
    if rounds[0].get("rss_parts_mb"):
        out["rss_parts_mb"] = {k: common.statistics.median(r["rss_parts_mb"][k] for r in rounds)
                               for k in rounds[0]["rss_parts_mb"]}
    if rounds[0].get("cuda_peak_mb") is not None:
        out["cuda_peak_mb"] = median("cuda_peak_mb")
    if rounds[0].get("verify_s") is not None:
        out["verify_s"] = measure.stats([r["verify_s"] for r in rounds])
    if rounds[0].get("log"):
        out["log"] = rounds[0]["log"]
    return out


def show_runs(runs: dict) -> None:
    for mode, r in runs.items():
        if "step" in r:
            print(f"{mode:<7} step {common.fmt_s(r['step'], 'ms', 1000)}  peak RSS {r['maxrss_mb']:.0f} MiB  "
                  f"(steady {r['step_peak']['median']:.0f}, baseline {r['baseline_rss_mb']:.0f})", flush=True)
