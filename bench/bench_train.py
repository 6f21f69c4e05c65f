"""Part 2: train-dpo step time and peak memory: cached reference vs live reference vs policy-only vs TRL.

Each configuration runs in a process of its own (so none shares another's heap), on the same model, data, batch and
precision, for `warmup + steps` optimizer steps:
  policy   the limit: the same Trainer, collator and completion_logps forward/backward, with a loss that needs no
           reference values (the DPO loss against a constant zero reference)
  cached   train-dpo --ref-cache (dpo.recipe.run_train): verifies the cache, never loads the reference
  live     train-dpo --ref-model (run_train): a second copy of the model, one extra no-grad forward per step
  trl      trl.DPOTrainer with a live reference model (CPU: use_cpu, no bf16, no gradient checkpointing)
Step time: interval between consecutive on_step_end callbacks (everything in the loop: collation, forward,
backward, optimizer), median over the steps after the warm-up. Memory: the process's peak RSS up to the end of the
last step (getrusage ru_maxrss; on CUDA also torch.cuda.max_memory_allocated), and the steady-state peak RSS within
each step (VmHWM reset at every step end).

    .venv/bin/python bench/bench_train.py [--quick]
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import common
from common import torch

# rounds: every configuration runs once per round, in turn, so that load from other processes on a shared machine
# falls on all of them alike; step times are pooled over the rounds.
QUICK = dict(model="5M", seq=256, batch=4, warmup=1, steps=3, rounds=2)
FULL = dict(model="35M", seq=512, batch=2, warmup=1, steps=3, rounds=2)
GPU = dict(model="350M", seq=1024, batch=8, warmup=3, steps=10, rounds=2)
MODES = ("policy", "cached", "live", "trl")


# ---------------------------------------------------------------------------------------------------------------
# child: one configuration

def step_timer(profile=None, profile_after: int = 0):
    """A TrainerCallback timing each step and reading the peak RSS within it; with `profile` (a torch.profiler),
    profiles the steps after the first `profile_after`."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.step_s, self.step_peak_mb, self.step_cuda_mb, self.last = [], [], [], None
            self.maxrss_mb = self.cuda_peak_mb = self.rss_parts_mb = None
            self.profiling = False

        def on_train_begin(self, args, state, control, **kw):
            common.sync()
            common.reset_peak()
            self.last = time.perf_counter()

        def on_train_end(self, args, state, control, **kw):
            if self.profiling:
                profile.__exit__(None, None, None)
                self.profiling = False

        def on_step_end(self, args, state, control, **kw):
            common.sync()
            now = time.perf_counter()
            self.step_s.append(now - self.last)
            self.step_peak_mb.append(common.peak_rss_mb())
            self.step_cuda_mb.append(common.cuda_peak_mb())
            self.last = now
            # the whole-run peaks, read before the next step resets the counters
            self.maxrss_mb = common.maxrss_mb()
            self.rss_parts_mb = common.rss_parts_mb()  # at the end of the step
            self.cuda_peak_mb = max(self.cuda_peak_mb or 0, self.step_cuda_mb[-1] or 0) or None
            if profile is not None and state.global_step == profile_after:
                profile.__enter__()
                self.profiling = True
            common.reset_peak()

    return StepTimer()


def train_config(a, mode: str, out: str):
    from dpo.recipe import TrainConfig

    cuda = torch.cuda.is_available()
    return TrainConfig(
        model=a.model, data=a.data, output_dir=out, ref_cache=a.cache if mode == "cached" else None,
        ref_model=a.model if mode == "live" else None, max_length=a.seq, max_steps=a.warmup + a.steps,
        per_device_train_batch_size=a.batch, logging_steps=1000, save_strategy="no", plot=False,
        use_cpu=not cuda, bf16=cuda, report_to="none", eval_on_start=False,
        overwrite_output_dir=True,  # each timed round trains again into the same scratch folder
    )


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


def run_ours(a, mode: str, timer, out: str) -> dict:
    """cached and live: the real train-dpo entry point, with the step timer added to its Trainer."""
    return {"verify_s": run_timed(train_config(a, mode, out), timer).get("verify_s")}


def run_policy(a, timer, out: str) -> dict:
    """policy-only: what run_train builds, minus every reference value (a constant zero reference)."""
    import datasets
    from transformers import AutoModelForCausalLM

    from dpo.trainer import DPOTrainer, PairCollator, disable_dropout
    from dpo.verify import encode_only
    from runtime.checkpoint import load_tokenizer
    from schemas.encoding import EncodingConfig

    class PolicyOnly(DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            zeros = torch.zeros(int(inputs["completion_lens"].sum()), device=inputs["input_ids"].device)
            return super().compute_loss(model, {**inputs, "ref_logps": zeros}, return_outputs, num_items_in_batch)

    cfg = train_config(a, "policy", out)
    tok = load_tokenizer(a.model)
    rows = encode_only(tokenizer=tok, data=a.data, split="train", encoding=EncodingConfig(max_length=a.seq))
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    policy = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, use_safetensors=True)
    disable_dropout(policy)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    trainer = PolicyOnly(model=policy, args=cfg.training_arguments(), data_collator=PairCollator(pad_id),
                         train_dataset=datasets.Dataset(rows.table), processing_class=tok, callbacks=[timer],
                         loss_config=cfg.loss_config(), ref_model=None)
    trainer.train()
    return {}


def run_trl(a, timer, out: str) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    policy = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, use_safetensors=True)
    ref = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(a.model)
    rows = [json.loads(l) for l in Path(a.data).read_text().splitlines() if l.strip()]
    ds = datasets.Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    cfg = train_config(a, "trl", out)
    args = DPOConfig(
        output_dir=out, max_length=a.seq, per_device_train_batch_size=a.batch, max_steps=a.warmup + a.steps,
        learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler_type, beta=cfg.beta,
        loss_type=["sigmoid"], optim=cfg.optim, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
        seed=cfg.seed, data_seed=cfg.seed, use_cpu=not cuda, bf16=cuda, fp16=False, gradient_checkpointing=False,
        report_to="none", save_strategy="no", logging_steps=1000, disable_tqdm=True,
        dataloader_pin_memory=cuda,
    )
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=ds, processing_class=tok,
                         callbacks=[timer])
    trainer.train()
    return {}


def child(a) -> dict:
    common.quiet()
    import datasets, polars, transformers  # noqa: F401,E401  (so the baseline includes the libraries)
    base = common.rss_mb()
    profile = None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        profile = torch_profile(activities=acts)
    timer = step_timer(profile, a.warmup)
    out = str(Path(a.out) / a.child)
    if a.child in ("cached", "live"):
        extra = run_ours(a, a.child, timer, out)
    elif a.child == "policy":
        extra = run_policy(a, timer, out)
    else:
        extra = run_trl(a, timer, out)
    r = {"mode": a.child, "baseline_rss_mb": base, "maxrss_mb": timer.maxrss_mb, "cuda_peak_mb": timer.cuda_peak_mb,
         "step_s": timer.step_s[a.warmup :], "warmup_s": timer.step_s[: a.warmup],
         "step_peak_rss_mb": timer.step_peak_mb[a.warmup :], "rss_parts_mb": timer.rss_parts_mb, **extra}
    if profile is not None:
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        r["profile"] = profile.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=48)
    return r


# ---------------------------------------------------------------------------------------------------------------
# parent

def prepare(size: dict, work: Path):
    from precompute.job import PrecomputeConfig, run_precompute
    from schemas.encoding import EncodingConfig

    model_dir = common.make_checkpoint(work, size["model"])
    pairs = size["batch"] * (size["warmup"] + size["steps"])  # one epoch covers every step
    rows = common.synthetic_pairs(pairs, size["seq"], common.MODELS[size["model"]]["vocab"], seed=2)
    data = common.write_jsonl(work / "data" / "train.jsonl", rows)
    cache = work / "cache"
    t = time.perf_counter()
    res = run_precompute(PrecomputeConfig(model=str(model_dir), data=str(data), out=str(cache), progress=False,
                                          encoding=EncodingConfig(max_length=size["seq"])), log=lambda m: None)
    return model_dir, data, cache, {"pairs": pairs, "precompute_s": time.perf_counter() - t, "tokens": res["tokens"],
                                    "padding_fraction": res["padding_fraction"]}


def child_args(size, model_dir, data, cache, work, mode, profile=False) -> list[str]:
    args = [__file__, "--child", mode, "--model", str(model_dir), "--data", str(data), "--cache", str(cache),
            "--seq", str(size["seq"]), "--batch", str(size["batch"]), "--warmup", str(size["warmup"]),
            "--steps", str(size["steps"]), "--out", str(work / "runs")]
    return args + (["--profile"] if profile else [])


def summarize(rounds: list[dict]) -> dict:
    """Pool the rounds of one configuration."""
    pooled = lambda key: [v for r in rounds for v in r[key]]
    out = {"mode": rounds[0]["mode"], "rounds": rounds,
           "step": common.stats(pooled("step_s")), "step_peak": common.stats(pooled("step_peak_rss_mb")),
           "maxrss": common.stats([r["maxrss_mb"] for r in rounds]),
           "baseline_rss_mb": common.statistics.median(r["baseline_rss_mb"] for r in rounds)}
    out["maxrss_mb"] = out["maxrss"]["median"]
    if rounds[0].get("rss_parts_mb"):
        out["rss_parts_mb"] = {k: common.statistics.median(r["rss_parts_mb"][k] for r in rounds)
                               for k in rounds[0]["rss_parts_mb"]}
    if rounds[0].get("cuda_peak_mb") is not None:
        out["cuda_peak_mb"] = common.statistics.median(r["cuda_peak_mb"] for r in rounds)
    if rounds[0].get("verify_s") is not None:
        out["verify_s"] = common.stats([r["verify_s"] for r in rounds])
    return out


def main():
    ap = common.child_parser(__doc__, MODES)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    common.quiet()
    dev = common.device()
    size = GPU if dev.type == "cuda" else (QUICK if args.quick else FULL)
    if dev.type == "cuda" and args.quick:
        size = {**size, "model": "35M", "warmup": 2, "steps": 5}
    work = common.workdir("train")
    try:
        model_dir, data, cache, info = prepare(size, work)
        modes = [m for m in MODES if m != "trl" or _has_trl()]
        rounds = {m: [] for m in modes}
        for n in range(size["rounds"]):
            for mode in modes:
                t = time.perf_counter()
                rounds[mode].append(common.run_child(child_args(size, model_dir, data, cache, work, mode)))
                r = rounds[mode][-1]
                print(f"round {n} {mode:<7} steps {' '.join(f'{v * 1000:.0f}' for v in r['step_s'])} ms  peak RSS "
                      f"{r['maxrss_mb']:.0f} MiB [{time.perf_counter() - t:.0f} s]", flush=True)
        runs = {m: summarize(v) for m, v in rounds.items()}
        for mode, r in runs.items():
            print(f"{mode:<7} step {common.fmt_s(r['step'], 'ms', 1000)}  peak RSS {r['maxrss_mb']:.0f} MiB  "
                  f"(steady {r['step_peak']['median']:.0f}, baseline {r['baseline_rss_mb']:.0f})", flush=True)
        p, c, l = runs["policy"], runs["cached"], runs["live"]
        res = {
            "size": size, "params": common.n_params(common.build_llama(size["model"])), **info, "runs": runs,
            "ratio_cached_vs_policy": common.ratio(c["step"], p["step"]),
            "ratio_cached_vs_live": common.ratio(c["step"], l["step"]),
            "mem_cached_vs_policy": c["maxrss_mb"] / p["maxrss_mb"],
            "mem_steady_cached_vs_policy": c["step_peak"]["median"] / p["step_peak"]["median"],
            "mem_cached_vs_live": c["maxrss_mb"] / l["maxrss_mb"],
        }
        if dev.type == "cuda":
            res["cuda_mem_cached_vs_policy"] = c["cuda_peak_mb"] / p["cuda_peak_mb"]
            res["cuda_mem_cached_vs_live"] = c["cuda_peak_mb"] / l["cuda_peak_mb"]
        if "trl" in runs:
            res["ratio_cached_vs_trl"] = common.ratio(c["step"], runs["trl"]["step"])
            res["mem_cached_vs_trl"] = c["maxrss_mb"] / runs["trl"]["maxrss_mb"]
        # A missed step-time target: profile the configurations involved (a separate run: the profiler slows steps).
        missed = []
        if res["ratio_cached_vs_policy"] > 1.05:
            missed += ["policy", "cached"]
        if res["ratio_cached_vs_live"] > 0.75:
            missed += ["cached", "live"]
        res["profiles"] = {}
        for mode in dict.fromkeys(missed):
            prof_size = {**size, "warmup": 1, "steps": 2, "rounds": 1}
            r = common.run_child(child_args(prof_size, model_dir, data, cache, work, mode, profile=True))
            res["profiles"][mode] = r.get("profile")
            print(f"profiled {mode}", flush=True)
        print(f"cached/policy {res['ratio_cached_vs_policy']:.3f}x  cached/live {res['ratio_cached_vs_live']:.3f}x  "
              f"memory cached/policy {res['mem_cached_vs_policy']:.3f}x", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {common.save('train', res, args.quick)}")


def _has_trl() -> bool:
    try:
        import trl  # noqa: F401  (availability probe)
        return True
    except ImportError:
        return False


if __name__ == "__main__":
    main()
