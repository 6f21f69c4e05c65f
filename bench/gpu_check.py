"""The GPU check: one script that shows, on one GPU in under 8 minutes, that refcache's numbers and speed hold there.

    bench/gpu_check.sh --results DIR              # a GPU: ~1.1B Llama-style model, bf16, under an 8-minute limit
    bench/gpu_check.sh --cpu-smoke --results DIR  # the same code paths on CPU, tiny sizes, float32
    python bench/gpu_check.py [...]               # the same without the limit or the carried wheels

On a bare device (README "GPU check": the command, its carry list, the wheels of bench/prepare_device.py) it is
one command; scripts/rehearse-device.sh runs that command here, with --cpu-smoke, in a venv of the device image's
packages plus only those wheels, from a fresh clone.

It prints two Markdown tables and writes them as JSON to <results>/gpu_check-<device>[-quick].json, after each stage
(with "complete": false until the end), so that a run stopped at its limit still leaves what it measured:

1. precompute-ref, the real command (precompute.cli.main, one child process per attention implementation: sdpa and,
   where flash_attn is installed, flash_attention_2) in bf16 over synthetic preference pairs, on a Llama-style model
   built here at a fixed seed (random init, saved in bf16 with a word-level tokenizer; no hub). Per implementation:
   the batching mode it chose, tokens/s of the scoring (plain-sequence tokens, the command's own count, over the
   time spent scoring and writing the shards) and end to end (the command's summary: reading, hashing, loading,
   probing too), the share of the GPU's peak dense bf16 FLOP/s that the scoring reaches, its peak memory, and
   its cache against a float32 forward of the same weights: `runtime.logprobs.reference_logps` (the definition)
   in float32 with TF32 off, one sequence at a time, on the first pairs of the cache (read with
   schemas.cache.read_cache), max and mean |cache - fp32| over their completion tokens, beside the product's bf16
   tolerance (runtime.tolerance.probe_tolerance).
2. train-dpo (dpo.recipe.run_train, the command's entry point, bf16 mixed precision, one child process per
   configuration): step time (median after a warm-up) and peak memory (torch.cuda.max_memory_allocated over the
   steps; on CPU the process's peak RSS) with the cache vs a live reference (padded layout, like TRL), and the
   prefix_shared vs padded batch layout (both with the cache).

FLOPs are those of the pairs' own work, each prompt once (no mode needs less): 2 x N per token (N: the parameters
other than the input embedding, whose lookup is no matmul) plus 4 x layers x hidden per token and key attended,
causal. The peak is the datasheet's dense bf16 figure for the device's name (gpu_figures.PEAK_BF16_TFLOPS, each
with where it was checked); for a device not in the table, the rate of a large torch.mm measured here, and the
table says so. The mm rate is measured and shown on every device, as what this device's matmul actually reaches.

Sizing (8 minutes on an H200; GPU_CHECK_LIMIT, set by gpu_check.sh, is the limit: a child that would start with
under MIN_CHILD_S left is skipped and says so). The H200 figures at hand are a floor for the rates: the 35M model's
eager scoring in bf16 (bench/results/gpu-compile-h200.json) ran 49,152 tokens in 0.0666 s, 2 x 29.4M linear
parameters x 49,152 = 2.9 TFLOP, i.e. 43 TFLOP/s (4% of 989: a model that small is launch-bound; a 1.1B model's
matmuls are ~40x larger), and KINDS.md's 8192^3 bf16 torch.mm ran at 788 TFLOP/s. The 1.1B model has 1.03B linear
parameters, 2.07 GFLOP per token. precompute-ref: 1024 pairs of prompt and completions each 256-511 tokens, ~1,150
tokens per pair scored once = 1.2M tokens, 2.4 PFLOP (+4% attention): 58 s at the 43 TFLOP/s floor, 3 s at the mm
rate; with its start (imports ~15 s, write, hash and load 2.2 GB ~15 s, probe ~10 s) at most ~100 s. The fp32
truth: 96 sequences of ~770 tokens, 0.15 PFLOP at a fp32 rate of >= 10 TFLOP/s (67 datasheet, no TF32): <= 15 s, with
its load ~25 s. train-dpo, 3 children of 8 steps (2 warm-up) of 8 pairs = 16 sequences of ~770 tokens: 6 x 1.03B x
12.3k = 76 TFLOP a step (+25 with a live reference): <= 2.4 s a step at the floor, ~20 s a child, with its start
(imports, load, AdamW state of 1.1B = 17.6 GB) ~50 s: ~150 s. With the parent's imports, the mm rate and building
and saving the model (~35 s): ~330 s at the floor, inside 480 s; the carried wheels' install comes before, outside
the limit, and the device tool's 10-minute command holds both.

With --cpu-smoke the GPU is hidden (CUDA_VISIBLE_DEVICES=""), so everything runs on the CPU at tiny sizes in float32
(bf16 on CPU says nothing about a GPU): tests/bench/test_gpu_check.py runs it, so the check is known to work before
a GPU is at hand. --quick is the same tiny sizes on whatever device is present.
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # before torch is imported (by common): the children inherit it
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import argparse
import contextlib
import importlib.util
import io
import json
import math
import time
from pathlib import Path

import common
import measure
import prepare_device
import train_steps
from common import torch
from gpu_figures import TRAIN, model_shape, pairs_flops, peak, tables

PART = "gpu_check"
SCRIPT = str(Path(__file__).resolve())

# The ~1.1B model (TinyLlama's shapes: hidden 2048 x 22 layers, 32 heads, 4 key/value heads, vocab 32k).
GPU_MODEL = "1.1B"
common.MODELS.setdefault(GPU_MODEL, dict(hidden=2048, layers=22, heads=32, kv=4, inter=5632, vocab=32000))

SIZES = {
    # pairs: precompute's data (and train-dpo's); truth_pairs: the first pairs compared with the fp32 forward
    "gpu": dict(model=GPU_MODEL, pairs=1024, seq=1024, token_budget=32768, truth_pairs=48, batch=8, warmup=2, steps=6),
    "smoke": dict(model="1M", pairs=8, seq=48, token_budget=4096, truth_pairs=8, batch=2, warmup=1, steps=2),
}
CHILD_TIMEOUT_S = 300
# gpu_check.sh's limit (seconds) and when it ends (epoch seconds); unset (a run without it): none
LIMIT_S = float(os.environ.get("GPU_CHECK_LIMIT") or 0) or None
DEADLINE = float(os.environ.get("GPU_CHECK_DEADLINE") or math.inf)
SAVE_MARGIN_S = 15  # kept back from the limit to write the results
MIN_CHILD_S = 30  # the least a child (or the fp32 truth) is started with


def time_left() -> float:
    return DEADLINE - SAVE_MARGIN_S - time.time()


def out_of_time() -> str | None:
    """Why a stage is not started (too little time left), or None."""
    left = time_left()
    return None if left >= MIN_CHILD_S else f"the time limit: {max(left, 0):.0f} s left of GPU_CHECK_LIMIT={LIMIT_S or 0:g}"


def not_run(r: dict) -> bool:
    return "error" in r or "skipped" in r


# ---------------------------------------------------------------------------------------------------------------
# the model and data


def build_case(work: Path, size: dict, dev: torch.device, dtype: torch.dtype) -> tuple[Path, Path, dict]:
    """The checkpoint (built on `dev` at a fixed seed, saved in `dtype`, with its word tokenizer), the data file and
    the model's shape."""
    spec = common.MODELS[size["model"]]
    path = work / f"model-{size['model']}"
    with torch.device(dev):  # random init on the GPU: seconds, not a minute of CPU for 1.1B parameters
        model = common.build_llama(size["model"], seed=0, max_positions=max(2048, size["seq"]))
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    common.word_tokenizer(spec["vocab"]).save_pretrained(path)
    shape = model_shape(model)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    rows = common.synthetic_pairs(size["pairs"], size["seq"], spec["vocab"], seed=1)
    return path, common.write_jsonl(work / "data" / "train.jsonl", rows), shape


# ---------------------------------------------------------------------------------------------------------------
# child processes: one precompute-ref per attention implementation, one train-dpo per configuration


def precompute_argv(a) -> list[str]:
    return ["--model", a.model, "--data", a.data, "--out", a.out, "--dtype", a.dtype, "--attn-implementation", a.attn,
            "--max-length", str(a.seq), "--token-budget", str(a.token_budget), "--no-progress", "--overwrite"]


def child_precompute(a) -> dict:
    """precompute-ref through its click command (precompute.cli.main), in this process: the summary it prints and
    the time spent in its scoring loop (precompute.job._score_shards, wrapped to read a clock, not changed)."""
    from precompute import cli, job

    seen = {"score_s": 0.0}
    score_shards, run_precompute = job._score_shards, job.run_precompute

    def timed_score(*args, **kw):
        common.sync()
        t = time.perf_counter()
        out = score_shards(*args, **kw)
        common.sync()
        seen["score_s"] += time.perf_counter() - t
        return out

    def keep_summary(*args, **kw):
        seen["summary"] = run_precompute(*args, **kw)
        return seen["summary"]

    job._score_shards, job.run_precompute = timed_score, keep_summary
    err = io.StringIO()  # a fresh process: its peak memory is this command's
    code = 0
    try:
        with contextlib.redirect_stderr(err):
            cli.main(precompute_argv(a), standalone_mode=False)
    except SystemExit as e:
        code = e.code or 0
    finally:
        sys.stderr.write(err.getvalue())
    if code or "summary" not in seen:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        return {"attn": a.attn, "error": f"precompute-ref exited {code}: {' '.join(lines[-3:])[:400]}"}
    s = seen["summary"]
    return {"attn": a.attn, "mode": s["mode"], "tokens": s["tokens"], "wall_s": s["wall_s"],
            "tokens_per_s_end_to_end": s["tokens_per_s"], "score_s": seen["score_s"],
            "padding_fraction": s["padding_fraction"], "peak_mb": measure.cuda_peak_mb() or measure.maxrss_mb()}


def child_train(a) -> dict:
    reference, layout = TRAIN[a.child]
    runner = lambda a, timer, out: train_steps.run_ours(a, reference, timer, out, batch_layout=layout)
    r = train_steps.child(a, {a.child: runner}, report_errors=True)
    if "error" not in r:
        r["peak_mb"] = r["cuda_peak_mb"] if r.get("cuda_peak_mb") is not None else r["maxrss_mb"]
    return r


def run_child(mode: str, **options) -> dict:
    """One child's result; its failure is the result ({"error": ...}), so that the other rows still come, and so is
    a child not started for the time limit ({"skipped": ...}); a child is stopped at the limit."""
    t = time.perf_counter()
    if skipped := out_of_time():
        r = {"skipped": skipped}
    else:
        try:
            timeout = min(CHILD_TIMEOUT_S, time_left())
            r = common.run_child(common.child_argv(SCRIPT, mode, **options), timeout=timeout)
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[-600:]}"}
    r["child_wall_s"] = time.perf_counter() - t
    print(f"  {mode}{' ' + options['attn'] if 'attn' in options else ''}: "
          f"{r.get('error') or r.get('skipped') or 'done'} [{r['child_wall_s']:.0f} s]", flush=True)
    return r


# ---------------------------------------------------------------------------------------------------------------
# the cache against the fp32 forward


def fp32_truth(model_dir: Path, caches: dict, n_pairs: int, dev: torch.device) -> dict:
    """Per cache (attention -> folder): max and mean |cached - reference_logps in float32| over the completion tokens
    of the first `n_pairs` rows (the same rows of every cache, by id), and the number of tokens compared."""
    import numpy as np

    from runtime.checkpoint import Checkpoint
    from runtime.logprobs import reference_logps
    from schemas.cache import read_cache

    columns = ["id", "prompt_input_ids", "chosen_input_ids", "rejected_input_ids", "chosen_logps", "rejected_logps"]
    frames = {attn: read_cache(root).select(columns).collect() for attn, root in caches.items()}
    if not frames:
        return {}
    first = next(iter(frames.values())).head(n_pairs)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32: the truth is float32 arithmetic
    try:
        model = Checkpoint.open(str(model_dir)).load_model(torch.float32, dev, "eager")
        t = time.perf_counter()
        truth = {side: [reference_logps(model, p, c).cpu().numpy()
                        for p, c in zip(first["prompt_input_ids"].to_list(), first[f"{side}_input_ids"].to_list())]
                 for side in ("chosen", "rejected")}
        common.sync()
        truth_s = time.perf_counter() - t
        del model
    finally:
        torch.set_float32_matmul_precision(precision)
    want = np.concatenate(truth["chosen"] + truth["rejected"])
    out = {}
    for attn, frame in frames.items():
        rows = first.select("id").join(frame, on="id", how="left", maintain_order="left")
        got = np.concatenate([np.asarray(v, np.float32) for side in ("chosen", "rejected")
                              for v in rows[f"{side}_logps"].to_list()])
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        out[attn] = {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()), "tokens": int(diff.size),
                     "pairs": first.height, "truth_s": truth_s}
    return out


def cache_lengths(root: Path):
    from schemas.cache import read_cache

    import polars as pl

    lens = read_cache(root).select(pl.col(f"{p}_input_ids").list.len() for p in ("prompt", "chosen", "rejected"))
    return [s.to_numpy() for s in lens.collect().get_columns()]


# ---------------------------------------------------------------------------------------------------------------
# the check


def attention_implementations(dev: torch.device) -> dict:
    """attention -> None (to run) or why it is not run."""
    flash = None if dev.type == "cuda" and importlib.util.find_spec("flash_attn") else (
        "flash_attn is not installed" if dev.type == "cuda" else "CUDA only")
    return {"sdpa": None, "flash_attention_2": flash}


def check(a, save) -> dict:
    """The check's result; `save(result)` is called after each stage with the result so far."""
    dev = common.device()
    smoke = a.cpu_smoke or a.quick
    size = SIZES["smoke" if smoke else "gpu"]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # bf16 on CPU says nothing about a GPU
    dtype_name = str(dtype).removeprefix("torch.")
    common.quiet()
    t0 = time.perf_counter()
    stages = {}
    out = {"size": size, "dtype": dtype_name, "device": dev.type, "limit_s": LIMIT_S, "complete": False,
           "packages": prepare_device.package_versions(), "stages_s": stages}
    with common.workdir("gpu-check") as work:
        t = time.perf_counter()
        out["peak"] = peak(dev, dtype)
        model_dir, data, shape = build_case(work, size, dev, dtype)
        out["model"] = shape
        stages["build"] = time.perf_counter() - t
        save(out)
        print(f"model {shape['params']:,} parameters, {size['pairs']} pairs of up to {size['seq']} tokens, "
              f"{dtype_name} on {out['peak']['device']} [{stages['build']:.0f} s]", flush=True)

        t = time.perf_counter()
        precompute, caches = {}, {}
        out["precompute"] = precompute
        for attn, skipped in attention_implementations(dev).items():
            if skipped:
                precompute[attn] = {"attn": attn, "skipped": skipped}
                continue
            cache = work / f"cache-{attn}"
            r = run_child("precompute", model=model_dir, data=data, out=cache, dtype=dtype_name, attn=attn,
                          seq=size["seq"], token_budget=size["token_budget"])
            if not not_run(r):
                caches[attn] = cache
                lens = cache_lengths(cache)
                r["flops"] = pairs_flops(*lens, shape)
                r["tokens_per_s"] = r["tokens"] / r["score_s"]
                r["share_of_peak"] = r["flops"] / r["score_s"] / (out["peak"]["tflops"] * 1e12)
            precompute[attn] = r
        stages["precompute"] = time.perf_counter() - t
        save(out)

        t = time.perf_counter()
        from runtime.tolerance import probe_tolerance

        if caches and (skipped := out_of_time()):
            out["fp32_truth_skipped"] = skipped
        elif caches:
            for attn, d in fp32_truth(model_dir, caches, size["truth_pairs"], dev).items():
                precompute[attn]["vs_fp32"] = {**d, "tolerance": probe_tolerance(dtype)}
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        stages["fp32_truth"] = time.perf_counter() - t
        save(out)

        t = time.perf_counter()
        train = {}
        out["train"] = train
        cache = caches.get("sdpa") or next(iter(caches.values()), None)
        for name in TRAIN:
            if cache is None:
                train[name] = {"error": "no cache: precompute-ref failed"}
                continue
            train[name] = run_child(name, model=model_dir, data=data, cache=cache, out=work / "runs", seq=size["seq"],
                                    batch=size["batch"], warmup=size["warmup"], steps=size["steps"])
            if not not_run(train[name]):
                train[name]["step"] = measure.stats(train[name]["step_s"])
            stages["train"] = time.perf_counter() - t
            save(out)
    stages["total"] = time.perf_counter() - t0
    out["complete"] = True
    return out


def main():
    ap = common.child_parser(__doc__, ["precompute", *TRAIN])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (the GPU hidden), in float32")
    for name in ("--attn", "--dtype", "--token-budget"):  # what the parent starts a precompute child with
        ap.add_argument(name, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child == "precompute":
        print(json.dumps(child_precompute(a)))
        return
    if a.child:
        print(json.dumps(child_train(a)))
        return
    a.quick = a.quick or a.cpu_smoke
    result = check(a, lambda partial: common.save(PART, partial, a))
    path = common.save(PART, result, a)
    print("\n" + "\n".join(tables(result)) + f"\n\nresults: {path}", flush=True)


if __name__ == "__main__":
    main()
