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
import os
from pathlib import Path

import common
import train_steps as steps
from common import np

CONFIGS = ("shared", "padded", "trl", "trl_pf")
LONG = dict(prompt=512, completion=128)


def long_pairs(n: int, vocab: int, prompt: int, completion: int, seed: int = 0) -> list[dict]:
    """Prompts of exactly `prompt` words, completions of `completion` (word tokenizer: one token per word)."""
    rng = np.random.default_rng(seed)
    words = lambda k: " ".join(f"w{i}" for i in rng.integers(3, vocab, size=k))
    return [{"id": f"p{i:05d}", "prompt": words(prompt), "chosen": " " + words(completion),
             "rejected": " " + words(completion)} for i in range(n)]


def run_ours(a, layout: str, timer, out: str) -> dict:  # on CPU, at the cache's max_length
    return steps.run_ours(a, "cached", timer, out, batch_layout=layout, max_length=None, use_cpu=True, bf16=False)


def run_trl(a, timer, out: str, padding_free: bool) -> dict:  # on CPU, float32, TRL's default optimizer
    return steps.run_trl(a, timer, out, data=a.data_file, padding_free=padding_free, optim="adamw_torch_fused",
                         use_cpu=True, bf16=False, dataloader_pin_memory=False)


RUNNERS = {"shared": lambda a, t, o: run_ours(a, "prefix_shared", t, o),
           "padded": lambda a, t, o: run_ours(a, "padded", t, o),
           "trl": lambda a, t, o: run_trl(a, t, o, padding_free=False),
           "trl_pf": lambda a, t, o: run_trl(a, t, o, padding_free=True)}


# ---------------------------------------------------------------------------------------------------------------
# parent


def prepare(case: str, size: dict, work: Path) -> dict:
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
    common.precompute(model_dir, data, cache, max_length)
    from runtime.data import encode_rows, load_rows

    encoded = encode_rows(load_rows(data), load_tokenizer(str(model_dir)), EncodingConfig(max_length=max_length))
    tokens = [2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in encoded.pairs]
    return {"model": str(model_dir), "data": str(data), "data_file": str(data_file), "cache": str(cache),
            "max_length": max_length, "tokens_per_step": float(np.mean(tokens)) * size["batch"],
            "pairs": len(tokens), "mean_prompt": float(np.mean([len(p.prompt_ids) for p in encoded.pairs]))}


def run_case(case: str, size: dict, work: Path, rounds: int) -> dict:
    info = prepare(case, size, work)
    argv = lambda mode: steps.child_argv(__file__, {**size, "seq": info["max_length"]}, info["model"],
                                         info["data"], info["cache"], work, mode, data_file=info["data_file"])
    results = common.rounds(rounds, CONFIGS, argv, lambda r: f"{case} {steps.step_line(r)}")
    runs = {}
    for mode, rs in results.items():
        runs[mode] = steps.summarize(rs)
        if "step" in runs[mode]:
            runs[mode]["tokens_per_s"] = info["tokens_per_step"] / runs[mode]["step"]["median"]
    ratios = {f"shared_vs_{m}": runs["shared"]["tokens_per_s"] / runs[m]["tokens_per_s"]
              for m in CONFIGS[1:] if "tokens_per_s" in runs.get(m, {})}
    return {"size": size, **info, "runs": runs, "ratios": ratios}


def main():
    ap = common.child_parser(__doc__, CONFIGS, paths=("model", "data", "data-file", "cache", "out"),
                             ints=("seq", "batch", "warmup", "steps", "rounds"))
    ap.add_argument("--cases", default="long,short")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(steps.child(args, RUNNERS, report_errors=True)))
        return
    common.quiet()
    size = dict(model=args.model or ("5M" if args.quick else "35M"), batch=args.batch or 2,
                warmup=args.warmup or 1, steps=args.steps or (2 if args.quick else 3))
    rounds = args.rounds or 2
    res = {"load_start": common.LOADAVG_START, "cases": {}}
    with common.workdir("layout") as work:
        for case in args.cases.split(","):
            case_size = {**size, "batch": 8} if case == "short" else size
            res["cases"][case] = run_case(case, case_size, work, rounds)
            for k, v in res["cases"][case]["ratios"].items():
                print(f"{case}: tokens/s {k} {v:.3f}x", flush=True)
    res["load_end"] = round(os.getloadavg()[0], 2)
    print(f"load average {res['load_start']} -> {res['load_end']}")
    path = common.save("layout", res, args)
    page = Path(args.results).parent / "RESULTS-layout.md"  # bench/RESULTS-layout.md beside bench/results
    page.write_text(render(json.loads(path.read_text())))
    print(f"wrote {path} and {page}")


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
