"""Part 16: torch.compile of the scoring forward (precompute-ref --torch-compile) and of the training step
(train-dpo --torch-compile), against the same work uncompiled, side by side.

Useful FLOP/s and the matmul rate are part 11's (bench_flops.py), so the shares compare with its table. Children:
  precompute  run_precompute end to end without and with --torch-compile, then score_pairs eager and compiled
              (precompute.compiled.compile_scoring; its first call, the compile, timed apart), interleaved with mm
  end_to_end  the precompute-ref CLI on a job of `e2e_pairs` pairs, one process per run: eager, compiled with a cold
              inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR), compiled warm, eager again; wall and CPU seconds
              (wait4) and the useful share against torch.mm timed before each run
  train, train_compiled, train_padded, train_padded_compiled  train-dpo's step (cached reference, prefix_shared or
              padded), eager and compiled; the warm-up steps (where the graphs compile) reported apart

    nice .venv/bin/python bench/bench_compile.py [--quick] [--configs end_to_end,train,...]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import bench_flops as F
import common
import measure
from common import torch

CONFIGS = ("precompute", "end_to_end", "train", "train_compiled", "train_padded", "train_padded_compiled")


def child_precompute(a) -> dict:
    from precompute.compiled import compile_scoring
    from precompute.job import PrecomputeConfig, run_precompute
    from precompute.modes import score_pairs
    from runtime.checkpoint import Checkpoint

    dev = common.device()
    encoding, pairs, pad_id = F.encoded_pairs(a)
    budget, per_shard = PrecomputeConfig.token_budget, PrecomputeConfig.rows_per_shard
    out, logs = Path(a.out) / "cache", []

    def refcache(compiled: bool) -> tuple[float, dict]:
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        s = run_precompute(PrecomputeConfig(model=a.model, data=a.data, out=str(out), encoding=encoding,
                                            progress=False, torch_compile=compiled), log=logs.append)
        return time.perf_counter() - t, s

    eager_wall, summary = refcache(False)
    compiled_wall, _ = refcache(True)
    made = json.loads((out / "manifest.json").read_text())["computation"]
    model = Checkpoint.open(a.model).load_model(common.torch_dtype(dev), dev, "sdpa")
    compiled = compile_scoring(model)
    mode = summary["mode"]

    def score(m):
        for s in range(0, len(pairs), per_shard):
            score_pairs(m, pairs[s : s + per_shard], pad_id, budget, mode)

    with torch.no_grad():
        t = time.perf_counter()
        score(compiled)  # compiles (inductor's cache is warm from the run above)
        first_call = time.perf_counter() - t
        fns = {"mm": F.mm_fn(common.torch_dtype(dev), dev), "score": lambda: score(model),
               "score_compiled": lambda: score(compiled)}
        times = measure.interleaved(fns, reps=a.reps, warmup=1)
    flops = F.forward_flops(F.model_shape(model), F.pair_lengths(pairs))
    return {"mode": mode, "pairs": len(pairs), "flops": flops, "times": times, "compiled_first_call_s": first_call,
            "refcache_wall_s": {"eager": eager_wall, "torch_compile": compiled_wall},
            "refcache_compiled": made.get("compiled"), "log": [m for m in logs if "torch.compile" in m]}


def child_end_to_end(a) -> dict:
    """precompute-ref's CLI, eager / compiled with a cold then a warm inductor cache / eager, one process each."""
    from precompute.job import PrecomputeConfig
    from runtime.checkpoint import Checkpoint

    dev = common.device()
    _, pairs, _ = F.encoded_pairs(a)
    mm = F.mm_fn(common.torch_dtype(dev), dev)
    inductor = Path(a.out) / "inductor"
    shutil.rmtree(inductor, ignore_errors=True)
    runs = []
    for name, compiled in (("eager", False), ("compiled_cold", True), ("compiled_warm", True), ("eager", False)):
        mm()  # the matmul rate just before the run: one unrecorded call, then three
        t, c = time.perf_counter(), time.process_time()
        for _ in range(3):
            mm()
        mm_s, mm_cpu = (time.perf_counter() - t) / 3, (time.process_time() - c) / 3
        out = Path(a.out) / f"e2e-{len(runs)}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "precompute.cli", "--model", a.model, "--data", a.data, "--out", str(out),
               "--max-length", str(a.seq), "--no-progress", *(["--torch-compile"] if compiled else [])]
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)  # this child's own: the runs it starts inherit it
        r = common.run_process(cmd, out.parent / f"{out.name}.log")
        log = (out.parent / f"{out.name}.log").read_text()
        made = json.loads((out / "manifest.json").read_text())["computation"]
        runs.append({"name": name, **r, "mm_s": mm_s, "mm_cpu_s": mm_cpu, "compiled": made.get("compiled"),
                     "log": [m.strip() for m in log.splitlines() if "torch.compile" in m]})
    shape = F.model_shape(Checkpoint.open(a.model).load_model(torch.float32, torch.device("cpu"), "sdpa"))
    flops = F.forward_flops(shape, F.pair_lengths(pairs))
    # one matmul rate for every run (the median of the four measurements): a single one swings with the load
    mm_s = common.statistics.median(r["mm_s"] for r in runs)
    mm_cpu = common.statistics.median(r["mm_cpu_s"] for r in runs)
    for r in runs:
        r["share_of_mm"] = flops["total"] / r["wall_s"] / (F.MM_FLOPS / mm_s)
        r["share_of_mm_cpu"] = flops["total"] / r["cpu_s"] / (F.MM_FLOPS / mm_cpu)
    return {"pairs": len(pairs), "flops": flops, "runs": runs, "token_budget": PrecomputeConfig.token_budget}


def summarize(case: dict, runs: dict) -> dict:
    out = {"case": case["name"], "size": case, "loadavg": {k: [r["loadavg"] for r in rs] for k, rs in runs.items()}}
    if runs.get("precompute"):
        rs = runs["precompute"]
        flops = rs[0]["flops"]["total"]
        share = {k: common.statistics.median(flops / r["times"][k]["median"] / (F.MM_FLOPS / r["times"]["mm"]["median"])
                                             for r in rs) for k in ("score", "score_compiled")}
        out["precompute"] = {
            "mode": rs[0]["mode"], "pairs": rs[0]["pairs"], "flops": rs[0]["flops"],
            "times": {k: measure.stats([v for r in rs for v in r["times"][k]["values"]]) for k in rs[0]["times"]},
            "share_of_mm": share, "compiled_over_eager": share["score_compiled"] / share["score"],
            "compiled_first_call_s": [r["compiled_first_call_s"] for r in rs],
            "refcache_wall_s": [r["refcache_wall_s"] for r in rs], "refcache_compiled": rs[0]["refcache_compiled"],
            "log": rs[0]["log"]}
    if runs.get("end_to_end"):
        out["end_to_end"] = runs["end_to_end"][0]
    for name in ("train", "train_compiled", "train_padded", "train_padded_compiled"):
        if runs.get(name):
            rs = runs[name]
            step_s, flops = [v for r in rs for v in r["step_s"]], [v for r in rs for v in r["step_flops"]]
            mm_rate = F.MM_FLOPS / common.statistics.median([v for r in rs for v in r["mm_s"]])
            rate = common.statistics.median([f / s for f, s in zip(flops, step_s)])
            out[name] = {"step": measure.stats(step_s), "warmup_step_s": [r["warmup_step_s"] for r in rs],
                         "useful_flops_per_s": rate, "share_of_mm": rate / mm_rate,
                         "maxrss_mb": common.statistics.median(r["maxrss_mb"] for r in rs),
                         "profile": rs[0].get("profile")}
    if "train" in out and "train_compiled" in out:
        out["train_step_eager_over_compiled"] = out["train"]["step"]["median"] / out["train_compiled"]["step"]["median"]
    if "train_padded" in out and "train_padded_compiled" in out:
        out["train_padded_step_eager_over_compiled"] = (out["train_padded"]["step"]["median"]
                                                        / out["train_padded_compiled"]["step"]["median"])
    return out


def cases(quick: bool) -> list[dict]:
    # warm-up 2: a compiled step's first shapes compile a static graph, the next new shapes a dynamic one
    return [dict(name="35M long prompt (512 + 128/128)", model="35M", prompt=512, completion=128, pairs=4 if quick else 8,
                 e2e_pairs=8 if quick else 32, batch=2, warmup=2, steps=2 if quick else 3, seq=1024,
                 reps=2 if quick else 3)]


def main():
    ap = common.child_parser(__doc__, CONFIGS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="which configurations to run (comma-separated)")
    a = ap.parse_args()
    if a.child:
        common.quiet()
        if a.child == "precompute":
            r = child_precompute(a)
        elif a.child == "end_to_end":
            r = child_end_to_end(a)
        else:
            layout = "padded" if a.child.startswith("train_padded") else "prefix_shared"
            r = F.child_train(a, layout, training_args={"torch_compile": a.child.endswith("_compiled")})
        print(json.dumps({"config": a.child, "loadavg": round(common.os.getloadavg()[0], 2), **r}, default=float))
        return
    common.quiet()
    results = []
    with common.workdir("compile") as work:
        for case in cases(a.quick):
            t = time.perf_counter()
            p = F.prepare(case, work)
            common.precompute(p["model"], p["train_data"], p["cache"], p["seq"])
            rows = F.long_prompt_rows(case["e2e_pairs"], common.MODELS[case["model"]]["vocab"], case["prompt"],
                                      case["completion"])
            e2e = common.write_jsonl(work / "e2e" / "train.jsonl", rows)

            def argv(mode, p=p, case=case):
                data = {"precompute": p["data"], "end_to_end": e2e}.get(mode, p["train_data"])
                return common.child_argv(__file__, mode, model=p["model"], data=data, cache=p["cache"], seq=p["seq"],
                                         batch=case["batch"], warmup=case["warmup"], steps=case["steps"],
                                         out=work / "runs", reps=case["reps"], profile=1)

            configs = [c for c in CONFIGS if c in a.configs.split(",")]
            runs = common.rounds(1, configs, argv, show=show)
            r = summarize(case, runs)
            r["loadavg_end"] = round(common.os.getloadavg()[0], 2)
            results.append(r)
            print(f"{case['name']}: {line(r)} [{time.perf_counter() - t:.0f} s]", flush=True)
    path = common.save("compile", {"cases": results}, a)
    print(f"wrote {path}")


def show(r: dict) -> str:
    if "runs" in r:
        return "; ".join(f"{x['name']} {x['wall_s']:.0f} s wall {x['cpu_s']:.0f} s CPU, share {x['share_of_mm']:.2f} "
                         f"(CPU {x['share_of_mm_cpu']:.2f})" for x in r["runs"])
    return F.show(r)


def line(r: dict) -> str:
    parts = []
    if "precompute" in r:
        p = r["precompute"]
        parts.append("score_pairs share of mm: " + ", ".join(f"{k} {v:.2f}" for k, v in p["share_of_mm"].items())
                     + f" (first compiled call {p['compiled_first_call_s'][0]:.0f} s)")
    if "end_to_end" in r:
        parts.append(f"precompute-ref CLI, {r['end_to_end']['pairs']} pairs: " + show(r["end_to_end"]))
    for name in ("train", "train_compiled", "train_padded", "train_padded_compiled"):
        if name in r:
            parts.append(f"{name} step {r[name]['step']['median']:.2f} s, share {r[name]['share_of_mm']:.2f}")
    return "; ".join(parts)


if __name__ == "__main__":
    main()
