"""train-dpo batch layouts: cached step with prefix sharing vs cached padded step vs TRL DPOTrainer (live reference,
its default padded layout) and TRL with padding_free, on long prompts and on data/'s short pairs.

Each configuration runs in a process of its own (own heap, own peak RSS), round-robin over the configurations so
load from other processes falls on all of them alike; step times pooled over the rounds, median after a warm-up:
  shared   train-dpo --ref-cache --batch-layout prefix_shared (run_train, the real entry point)
  padded   train-dpo --ref-cache --batch-layout padded
  trl      trl.DPOTrainer with a live reference (CPU: use_cpu, float32, no gradient checkpointing)
  trl_pf   the same with padding_free=True (TRL documents it for flash attention only; run as is, or reported)
Tokens/s counts the plain tokens of the pairs each step covers (2 x prompt + chosen + rejected per pair), the same
numerator for every configuration, so the ratios are ratios of step time.

    .venv/bin/python bench/bench_layout.py [--quick] [--cases long,short] [--model 35M]
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import common
from bench_train import run_timed, step_timer
from common import np, torch

CONFIGS = ("shared", "padded", "trl", "trl_pf")
LONG = dict(prompt=512, completion=128)


def long_pairs(n: int, vocab: int, prompt: int, completion: int, seed: int = 0) -> list[dict]:
    """Prompts of exactly `prompt` words, completions of `completion` (word tokenizer: one token per word)."""
    rng = np.random.default_rng(seed)
    words = lambda k: " ".join(f"w{i}" for i in rng.integers(3, vocab, size=k))
    return [{"id": f"p{i:05d}", "prompt": words(prompt), "chosen": " " + words(completion),
             "rejected": " " + words(completion)} for i in range(n)]


# ---------------------------------------------------------------------------------------------------------------
# child: one configuration


def run_ours(a, layout: str, timer, out: str) -> dict:
    from dpo.recipe import TrainConfig

    logs = []
    run_timed(TrainConfig(model=a.model, data=a.data, output_dir=out, ref_cache=a.cache, batch_layout=layout,
                          max_steps=a.warmup + a.steps, per_device_train_batch_size=a.batch, logging_steps=1000,
                          save_strategy="no", plot=False, use_cpu=True, eval_on_start=False, overwrite_output_dir=True),
              timer, log=logs.append)
    return {"log": [m for m in logs if m.startswith("batch layout")]}


def run_trl(a, timer, out: str, padding_free: bool) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    policy = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, use_safetensors=True)
    ref = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(a.model)
    rows = [json.loads(line) for line in Path(a.data_file).read_text().splitlines() if line.strip()]
    ds = datasets.Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    args = DPOConfig(
        output_dir=out, max_length=a.max_length, per_device_train_batch_size=a.batch, max_steps=a.warmup + a.steps,
        learning_rate=1e-6, beta=0.1, loss_type=["sigmoid"], seed=42, data_seed=42, use_cpu=True, bf16=False,
        fp16=False, gradient_checkpointing=False, report_to="none", save_strategy="no", logging_steps=1000,
        disable_tqdm=True, dataloader_pin_memory=False, padding_free=padding_free,
    )
    DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=ds, processing_class=tok,
               callbacks=[timer]).train()
    return {}


def child(a) -> dict:
    common.quiet()
    import datasets, polars, transformers  # noqa: F401,E401  (so the baseline includes the libraries)

    base = common.rss_mb()
    timer = step_timer()
    out = str(Path(a.out) / a.child)
    try:
        if a.child in ("shared", "padded"):
            extra = run_ours(a, "prefix_shared" if a.child == "shared" else "padded", timer, out)
        else:
            extra = run_trl(a, timer, out, padding_free=a.child == "trl_pf")
    except Exception as e:  # reported, not fatal: e.g. TRL's padding_free without flash attention
        return {"mode": a.child, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    return {"mode": a.child, "baseline_rss_mb": base, "maxrss_mb": timer.maxrss_mb,
            "step_s": timer.step_s[a.warmup:], "warmup_s": timer.step_s[:a.warmup], **extra}


# ---------------------------------------------------------------------------------------------------------------
# parent


def prepare(case: str, size: dict, work: Path) -> dict:
    from precompute.job import PrecomputeConfig, run_precompute
    from runtime.checkpoint import load_tokenizer
    from schemas.encoding import EncodingConfig

    pairs = size["batch"] * (size["warmup"] + size["steps"])
    if case == "short":
        model_dir, data = common.sft_data()
        data_file, max_length = data / "train.jsonl", 1024
    else:
        model_dir = common.make_checkpoint(work, size["model"])
        rows = long_pairs(pairs, common.MODELS[size["model"]]["vocab"], **LONG)
        data = data_file = common.write_jsonl(work / case / "train.jsonl", rows)
        max_length = LONG["prompt"] + LONG["completion"] + 8
    cache = work / case / "cache"
    run_precompute(PrecomputeConfig(model=str(model_dir), data=str(data), out=str(cache), progress=False,
                                    encoding=EncodingConfig(max_length=max_length)), log=lambda m: None)
    from runtime.data import encode_rows, load_rows

    encoded = encode_rows(load_rows(data), load_tokenizer(str(model_dir)), EncodingConfig(max_length=max_length))
    tokens = [2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in encoded.pairs]
    return {"model": str(model_dir), "data": str(data), "data_file": str(data_file), "cache": str(cache),
            "max_length": max_length, "tokens_per_step": float(np.mean(tokens)) * size["batch"],
            "pairs": len(tokens), "mean_prompt": float(np.mean([len(p.prompt_ids) for p in encoded.pairs]))}


def child_args(info: dict, size: dict, work: Path, mode: str) -> list[str]:
    return [__file__, "--child", mode, "--model", info["model"], "--data", info["data"], "--data-file",
            info["data_file"], "--cache", info["cache"], "--max-length", str(info["max_length"]), "--batch",
            str(size["batch"]), "--warmup", str(size["warmup"]), "--steps", str(size["steps"]), "--out",
            str(work / "runs")]


def run_case(case: str, size: dict, work: Path, rounds: int) -> dict:
    info = prepare(case, size, work)
    results = {m: [] for m in CONFIGS}
    for n in range(rounds):
        for mode in CONFIGS:
            if results[mode] and "error" in results[mode][-1]:
                continue
            t = time.perf_counter()
            r = common.run_child(child_args(info, size, work, mode))
            results[mode].append(r)
            shown = r.get("error") or (f"steps {' '.join(f'{v * 1000:.0f}' for v in r['step_s'])} ms, peak RSS "
                                       f"{r['maxrss_mb']:.0f} MiB {r.get('log', '')}")
            print(f"{case} round {n} {mode:<7} {shown} [{time.perf_counter() - t:.0f} s]", flush=True)
    runs = {}
    for mode, rs in results.items():
        if rs and "error" in rs[0]:
            runs[mode] = {"error": rs[0]["error"]}
            continue
        step = common.stats([v for r in rs for v in r["step_s"]])
        runs[mode] = {"step": step, "tokens_per_s": info["tokens_per_step"] / step["median"],
                      "maxrss_mb": common.statistics.median(r["maxrss_mb"] for r in rs),
                      "baseline_rss_mb": common.statistics.median(r["baseline_rss_mb"] for r in rs),
                      "log": rs[0].get("log")}
    ratios = {f"shared_vs_{m}": runs["shared"]["tokens_per_s"] / runs[m]["tokens_per_s"]
              for m in CONFIGS[1:] if "tokens_per_s" in runs.get(m, {})}
    return {"size": size, **info, "runs": runs, "ratios": ratios}


def main():
    ap = common.child_parser(__doc__, CONFIGS, paths=("model", "data", "data-file", "cache", "out"),
                             ints=("max-length", "batch", "warmup", "steps", "rounds"))
    ap.add_argument("--cases", default="long,short")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    common.quiet()
    size = dict(model=args.model or ("5M" if args.quick else "35M"), batch=args.batch or 2,
                warmup=args.warmup or 1, steps=args.steps or (2 if args.quick else 3))
    rounds = args.rounds or 2
    work = common.workdir("layout")
    res = {"load_start": common.LOADAVG_START, "cases": {}}
    try:
        for case in args.cases.split(","):
            case_size = {**size, "batch": 8} if case == "short" else size
            res["cases"][case] = run_case(case, case_size, work, rounds)
            for k, v in res["cases"][case]["ratios"].items():
                print(f"{case}: tokens/s {k} {v:.3f}x", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import os

    res["load_end"] = round(os.getloadavg()[0], 2)
    print(f"load average {res['load_start']} -> {res['load_end']}")
    path = common.save("layout", res, args.quick)
    (common.BENCH / "RESULTS-layout.md").write_text(render(json.loads(path.read_text())))
    print(f"wrote {path} and bench/RESULTS-layout.md")


def render(res: dict) -> str:
    """bench/RESULTS-layout.md from the saved JSON."""
    names = {"shared": "cached, prefix_shared", "padded": "cached, padded", "trl": "TRL DPOTrainer, live reference",
             "trl_pf": "TRL, padding_free"}
    L = ["# train-dpo batch layouts (bench/bench_layout.py)", "", f"Command: `{res['command']}`; "
         f"{common.machine_line(res['machine'])}; 1-minute load average {res['load_start']} -> {res['load_end']} "
         "(2 cores: above ~2 means other processes competed; the configurations ran interleaved, round-robin).", ""]
    for case, c in res["cases"].items():
        what = (f"{c['size']['model']} Llama-style model, prompt {LONG['prompt']}, completions {LONG['completion']}"
                if case == "long" else f"data/ (sft-model, mean prompt {c['mean_prompt']:.0f} tokens)")
        timed = next(r for r in c["runs"].values() if "step" in r)["step"]["n"]
        L += [f"## {case}: {what}, batch {c['size']['batch']} pairs, {c['size']['steps']} timed steps x "
              f"{timed // c['size']['steps']} rounds", "", "| configuration | step (median, min-max) | tokens/s | peak RSS MiB | prefix_shared vs it |",
              "|---|---|---|---|---|"]
        for mode, r in c["runs"].items():
            if "error" in r:
                L.append(f"| {names[mode]} | not run: {r['error']} | | | |")
                continue
            vs = c["ratios"].get(f"shared_vs_{mode}")
            L.append(f"| {names[mode]} | {common.fmt_s(r['step'], 'ms', 1000)} | {r['tokens_per_s']:,.0f} | "
                     f"{r['maxrss_mb']:,.0f} | {f'{vs:.2f}x' if vs else '-'} |")
        log = c["runs"].get("shared", {}).get("log")
        L += ["", f"Log of the prefix_shared run: `{' '.join(log)}`" if log else "", ""]
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    main()
