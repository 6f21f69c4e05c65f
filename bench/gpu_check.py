"""The GPU check: one script that shows, on one GPU in under 8 minutes, that refcache's numbers and speed hold there.

    bench/gpu_check.sh --results DIR              # a GPU: ~1.1B Llama-style model, bf16, under an 8-minute limit
    bench/gpu_check.sh --cpu-smoke --results DIR  # the same code paths on CPU, tiny sizes, float32
    python bench/gpu_check.py [...]               # the same without the limit or the carried wheels

On a bare device it is one command (README "GPU check": its carry list, the wheels of bench/prepare_device.py);
scripts/rehearse-device.sh runs it here with --cpu-smoke from a fresh clone. It prints two Markdown tables and saves
them as JSON to <results>/gpu_check-<device>[-quick].json after each stage ("complete": false until the end), so a
run stopped at its limit still leaves what it measured:

1. precompute-ref, the real command (precompute.cli.main, one child per attention implementation: sdpa, and
   flash_attention_2 where flash_attn is installed) in bf16 on a Llama-style model built here at a fixed seed: the
   batching mode, tokens/s of the scoring (time in precompute.job._score_shards) and end to end, the share of the
   device's peak dense bf16 FLOP/s, peak memory, and |cache - fp32| (runtime.logprobs.reference_logps in float32,
   TF32 off, on the first pairs) beside the bf16 tolerance (runtime.tolerance.probe_tolerance).
2. train-dpo (dpo.recipe.run_train, bf16 mixed precision, one child per configuration): step time and peak memory,
   cached vs live reference (padded) and prefix_shared vs padded (cached).

FLOPs: gpu_figures.pairs_flops (each prompt once). The peak: the datasheet figure for the device's name
(gpu_figures.PEAK_BF16_TFLOPS, with where each was checked), else the measured torch.mm rate, shown on every device.

Sizing: GPU_CHECK_LIMIT (set by gpu_check.sh) is the limit; a child that would start with under MIN_CHILD_S left is
skipped and says so. Estimated at the 43 TFLOP/s floor of the H200's measured 35M-model scoring
(bench/results/gpu-compile-h200.json): precompute-ref over 1.2M tokens (2.4 PFLOP) ~100 s with its start, the fp32
truth ~40 s, train-dpo's 3 children ~150 s, building the model ~35 s: ~330 s of the 480.

--cpu-smoke hides the GPU (CUDA_VISIBLE_DEVICES="") and runs tiny sizes in float32 (tests/bench/test_gpu_check.py
runs it); --quick is the same tiny sizes on whatever device is present.
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


# the model and data


def build_case(work: Path, size: dict, dev: torch.device, dtype: torch.dtype) -> tuple[Path, Path, dict]:
    """The checkpoint (built on `dev` at a fixed seed, saved in `dtype`), the data file, the model's shape."""
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
