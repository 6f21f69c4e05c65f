"""The GPU check: one script that shows, on one GPU in under 8 minutes, that refcache's numbers and speed hold there.

    python bench/gpu_check.py [--results DIR]               # a GPU: ~1.1B Llama-style model, bf16
    python bench/gpu_check.py --cpu-smoke [--results DIR]   # the same code paths on CPU, tiny sizes, float32
    bench/gpu_check.sh [...]                                 # the same, from any directory, under a time limit

It prints two Markdown tables (and writes them as JSON to <results>/gpu_check-<device>[-quick].json):

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
causal. The peak is the datasheet's dense bf16 figure for the device's name (PEAK_BF16_TFLOPS); for a device not in
the table, the rate of a large torch.mm measured here, and the table says so. The mm rate is measured and shown on
every device, as what this device's matmul actually reaches.

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
import re
import time
from pathlib import Path

import common
import measure
import train_steps
from common import torch

PART = "gpu_check"
SCRIPT = str(Path(__file__).resolve())

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s, by a pattern of the device's name
# (torch.cuda.get_device_name); the first pattern that matches wins, so the more specific ones come first.
PEAK_BF16_TFLOPS = [
    (r"GH200", 989.0),
    (r"H200", 989.0),
    (r"H100.*PCIe", 756.0),
    (r"H100.*NVL", 835.0),
    (r"H100|H800", 989.0),  # SXM: "NVIDIA H100 80GB HBM3"
    (r"B200", 2250.0),
    (r"A100|A800", 312.0),
    (r"L40S", 362.0),
    (r"L40\b", 181.0),
    (r"L4\b", 121.0),
    (r"A10\b", 125.0),
]

# The ~1.1B model (TinyLlama's shapes: hidden 2048 x 22 layers, 32 heads, 4 key/value heads, vocab 32k).
GPU_MODEL = "1.1B"
common.MODELS.setdefault(GPU_MODEL, dict(hidden=2048, layers=22, heads=32, kv=4, inter=5632, vocab=32000))

SIZES = {
    # pairs: precompute's data (and train-dpo's); truth_pairs: the first pairs compared with the fp32 forward
    "gpu": dict(model=GPU_MODEL, pairs=1024, seq=1024, token_budget=32768, truth_pairs=48, batch=8, warmup=2, steps=6),
    "smoke": dict(model="1M", pairs=8, seq=48, token_budget=4096, truth_pairs=8, batch=2, warmup=1, steps=2),
}
TRAIN = {  # configuration: (reference, batch layout)
    "cached_padded": ("cached", "padded"),
    "live_padded": ("live", "padded"),
    "cached_prefix_shared": ("cached", "prefix_shared"),
}
CHILD_TIMEOUT_S = 300


# ---------------------------------------------------------------------------------------------------------------
# FLOPs and the device's peak


def datasheet_peak(name: str) -> float | None:
    """The dense bf16 peak of a device by name, TFLOP/s; None for one not in PEAK_BF16_TFLOPS."""
    return next((peak for pattern, peak in PEAK_BF16_TFLOPS if re.search(pattern, name)), None)


def measured_mm_tflops(dev: torch.device, dtype: torch.dtype) -> float:
    """The rate of square torch.mm in `dtype` on `dev`, TFLOP/s (best of a few timed batches after a warm-up)."""
    n, reps = (8192, 20) if dev.type == "cuda" else (512, 4)
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    best = math.inf
    for i in range(4):
        common.sync()
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        common.sync()
        if i:  # the first batch is a warm-up
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 * reps / best / 1e12


def peak(dev: torch.device, dtype: torch.dtype) -> dict:
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else common.cpu_model()
    mm = measured_mm_tflops(dev, dtype)
    sheet = datasheet_peak(name) if dev.type == "cuda" else None
    dtype_name = str(dtype).removeprefix("torch.")
    source = ("datasheet, dense bf16" if sheet else
              f"not in the datasheet table: the measured torch.mm {dtype_name} rate")
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the children need the memory, not this process's allocator
    return {"device": name, "tflops": sheet or mm, "source": source, "mm_tflops": mm, "mm_dtype": dtype_name}


def model_shape(model) -> dict:
    cfg = model.config
    total = common.n_params(model)
    return {"params": total, "linear_params": total - model.get_input_embeddings().weight.numel(),
            "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads, "vocab": cfg.vocab_size,
            "attn_width": cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)}


def pairs_flops(prompt_lens, chosen_lens, rejected_lens, shape: dict) -> float:
    """FLOPs of scoring pairs, each prompt once: 2 x linear params per token, plus attention (QK^T and AV: 4 x
    width per key) over the keys each token attends causally: 1..P for the prompt, P+1..P+C for a completion."""
    import numpy as np

    p, c, r = (np.asarray(v, np.float64) for v in (prompt_lens, chosen_lens, rejected_lens))
    keys = p * (p + 1) / 2 + c * (2 * p + c + 1) / 2 + r * (2 * p + r + 1) / 2
    return float(2 * shape["linear_params"] * (p + c + r).sum()
                 + 4 * shape["layers"] * shape["attn_width"] * keys.sum())


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
    """One child's result; its failure is the result ({"error": ...}), so that the other rows still come."""
    t = time.perf_counter()
    try:
        r = common.run_child(common.child_argv(SCRIPT, mode, **options), timeout=CHILD_TIMEOUT_S)
    except Exception as e:
        r = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[-600:]}"}
    r["child_wall_s"] = time.perf_counter() - t
    print(f"  {mode}{' ' + options['attn'] if 'attn' in options else ''}: "
          f"{r.get('error') or 'done'} [{r['child_wall_s']:.0f} s]", flush=True)
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


def check(a) -> dict:
    dev = common.device()
    smoke = a.cpu_smoke or a.quick
    size = SIZES["smoke" if smoke else "gpu"]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # bf16 on CPU says nothing about a GPU
    dtype_name = str(dtype).removeprefix("torch.")
    common.quiet()
    t0 = time.perf_counter()
    stages = {}
    out = {"size": size, "dtype": dtype_name, "device": dev.type}
    with common.workdir("gpu-check") as work:
        t = time.perf_counter()
        out["peak"] = peak(dev, dtype)
        model_dir, data, shape = build_case(work, size, dev, dtype)
        out["model"] = shape
        stages["build"] = time.perf_counter() - t
        print(f"model {shape['params']:,} parameters, {size['pairs']} pairs of up to {size['seq']} tokens, "
              f"{dtype_name} on {out['peak']['device']} [{stages['build']:.0f} s]", flush=True)

        t = time.perf_counter()
        precompute, caches = {}, {}
        for attn, skipped in attention_implementations(dev).items():
            if skipped:
                precompute[attn] = {"attn": attn, "skipped": skipped}
                continue
            cache = work / f"cache-{attn}"
            r = run_child("precompute", model=model_dir, data=data, out=cache, dtype=dtype_name, attn=attn,
                          seq=size["seq"], token_budget=size["token_budget"])
            if "error" not in r:
                caches[attn] = cache
                lens = cache_lengths(cache)
                r["flops"] = pairs_flops(*lens, shape)
                r["tokens_per_s"] = r["tokens"] / r["score_s"]
                r["share_of_peak"] = r["flops"] / r["score_s"] / (out["peak"]["tflops"] * 1e12)
            precompute[attn] = r
        stages["precompute"] = time.perf_counter() - t

        t = time.perf_counter()
        from runtime.tolerance import probe_tolerance

        for attn, d in fp32_truth(model_dir, caches, size["truth_pairs"], dev).items():
            precompute[attn]["vs_fp32"] = {**d, "tolerance": probe_tolerance(dtype)}
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        stages["fp32_truth"] = time.perf_counter() - t
        out["precompute"] = precompute

        t = time.perf_counter()
        train = {}
        cache = caches.get("sdpa") or next(iter(caches.values()), None)
        for name in TRAIN:
            if cache is None:
                train[name] = {"error": "no cache: precompute-ref failed"}
                continue
            train[name] = run_child(name, model=model_dir, data=data, cache=cache, out=work / "runs", seq=size["seq"],
                                    batch=size["batch"], warmup=size["warmup"], steps=size["steps"])
            if "error" not in train[name]:
                train[name]["step"] = measure.stats(train[name]["step_s"])
        stages["train"] = time.perf_counter() - t
        out["train"] = train
    stages["total"] = time.perf_counter() - t0
    out["stages_s"] = stages
    return out


# ---------------------------------------------------------------------------------------------------------------
# the tables


def _g(v, digits=3) -> str:
    return f"{v:.{digits}g}"


def tables(r: dict) -> list[str]:
    """The check's result as Markdown lines: a header, the precompute table and the training table."""
    from report import table

    m, p, size = r["model"], r["peak"], r["size"]
    memory = "torch.cuda.max_memory_allocated" if r["device"] == "cuda" else "peak RSS"
    params = f"{m['params'] / 1e9:.2f}B" if m["params"] >= 1e9 else f"{m['params'] / 1e6:.1f}M"
    L = [f"Device: {p['device']}; peak {_g(p['tflops'])} TFLOP/s ({p['source']}); torch.mm {p['mm_dtype']} "
         f"measured {_g(p['mm_tflops'])} TFLOP/s. Model: Llama-style, {params} parameters (hidden "
         f"{m['hidden']} x {m['layers']} layers, {m['heads']} heads, {m['kv_heads']} key/value heads, vocab "
         f"{m['vocab']}), random init, {r['dtype']}. Data: {size['pairs']} synthetic pairs of up to {size['seq']} "
         f"tokens. Wall: {r['stages_s']['total']:.0f} s "
         f"({', '.join(f'{k} {v:.0f} s' for k, v in r['stages_s'].items() if k != 'total')}).", ""]
    rows = []
    for attn, c in r["precompute"].items():
        if "skipped" in c or "error" in c:
            rows.append([attn, f"not run: {c.get('skipped') or c.get('error')}"] + [""] * 7)
            continue
        v = c.get("vs_fp32") or {}
        diffs = ([f"{v['max_abs_diff']:.3g}", f"{v['mean_abs_diff']:.3g}",
                  f"{v['tokens']:,} ({v['pairs']} pairs); {v['tolerance']:g} "
                  f"({'within' if v['max_abs_diff'] <= v['tolerance'] else 'EXCEEDED'})"] if v else ["n/a"] * 3)
        rows.append([attn, c["mode"], f"{c['tokens_per_s']:,.0f}", f"{c['share_of_peak']:.1%}",
                     f"{c['score_s']:.2f} / {c['wall_s']:.1f}", f"{c['peak_mb']:,.0f} MiB", *diffs])
    L += [f"precompute-ref, {r['dtype']}:", ""]
    L += table(f"attention | batching | tokens/s (scoring) | share of peak | scoring / end-to-end s | {memory} | "
               "max abs diff vs fp32 | mean abs diff | tokens compared; tolerance", rows)
    rows = []
    base = r["train"].get("cached_padded", {})
    for name, t in r["train"].items():
        reference, layout = TRAIN[name]
        if "error" in t:
            rows.append([reference, layout, f"failed: {t['error'][:200]}", "", ""])
            continue
        ratio = (f"{measure.ratio(t['step'], base['step']):.2f}x" if "step" in base else "n/a")
        rows.append([reference, layout, f"{t['step']['median'] * 1000:,.1f} ms ({len(t['step_s'])} steps)", ratio,
                     f"{t['peak_mb']:,.0f} MiB"])
    L += ["", f"train-dpo, batch {size['batch']} pairs, {'bf16 mixed precision' if r['dtype'] == 'bfloat16' else 'float32'}:", ""]
    L += table(f"reference | batch layout | step time (median) | vs cached padded | {memory}", rows)
    return L


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
    result = check(a)
    path = common.save(PART, result, a)
    print("\n" + "\n".join(tables(result)) + f"\n\nresults: {path}", flush=True)


if __name__ == "__main__":
    main()
