"""Part 1: precompute-ref throughput against the bare forward pass (the limit) and TRL's reference precompute.

For each case (a model and a data set), round-robin in this one process:
  refcache    run_precompute end to end, default options, into a fresh output directory each time
  score-only  precompute.modes.score_pairs on the loaded model in the mode run_precompute picked (and in
              full_forward where that differs): forward + gather, no I/O
  bare        model(input_ids, attention_mask).logits over the same padded batches, no_grad: the limit
  trl         trl.DPOTrainer(precompute_ref_log_probs=True) construction with the model load, when trl is importable
Tokens/s count real (unpadded) prompt+completion tokens, the same numerator for all four.

    .venv/bin/python bench/bench_precompute.py [--quick]
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

import common
import measure
from common import torch

QUICK_CASES = [
    dict(name="data/", model="data", trl=True, reps=3),
    dict(name="5M@512", model="5M", seq=512, pairs=16, trl=True, reps=3, headline=True),
]
FULL_CASES = [
    dict(name="data/", model="data", trl=True, reps=5),
    dict(name="1M@128", model="1M", seq=128, pairs=256, trl=False, reps=3),
    dict(name="5M@512", model="5M", seq=512, pairs=32, trl=True, reps=3),
    dict(name="5M@1024", model="5M", seq=1024, pairs=12, trl=False, reps=3),
    dict(name="35M@512", model="35M", seq=512, pairs=12, trl=True, reps=3, headline=True),
]
GPU_CASES = [  # on CUDA: more pairs, and a larger model
    dict(name="data/", model="data", trl=True, reps=5),
    dict(name="5M@512", model="5M", seq=512, pairs=1024, trl=False, reps=3),
    dict(name="35M@512", model="35M", seq=512, pairs=1024, trl=True, reps=3),
    dict(name="350M@1024", model="350M", seq=1024, pairs=512, trl=True, reps=3, headline=True),
]


def cases(quick: bool, dev) -> list[dict]:
    if dev.type == "cuda":
        return GPU_CASES[:2] + GPU_CASES[3:] if quick else GPU_CASES
    return QUICK_CASES if quick else FULL_CASES


def prepare(case: dict, work: Path):
    """(model_dir, data_path, split, EncodingConfig) of a case; synthetic cases are written under work."""
    from schemas.encoding import EncodingConfig

    if case["model"] == "data":
        model_dir, data = common.sft_data()
        return model_dir, data, "train", EncodingConfig()
    model_dir, data = common.synthetic_case(work, case["model"], case["pairs"], case["seq"], seed=1,
                                            name=f"data-{case['name'].replace('@', '-')}")
    return model_dir, data, "train", EncodingConfig(max_length=case["seq"])


# where run_precompute spends its time: wrap the functions it calls (a few microseconds of overhead per call)

PHASES = {  # phase -> (module, attribute)
    "load tokenizer": ("runtime.checkpoint", "load_tokenizer"),
    "load data": ("precompute.prepare", "load_rows"),
    "encode": ("precompute.prepare", "usable_rows"),
    "model hash": ("runtime.checkpoint", "model_hash"),
    "load model": ("runtime.checkpoint", "Checkpoint.load_model"),
    "mode probe": ("precompute.job", "choose_mode"),
    "forward+gather": ("precompute.job", "score_known"),
    "build table": ("schemas.format", "shard_table"),
    "write shard": ("schemas.format", "write_shard"),
    "hash shard": ("schemas.format", "shard_entry"),
    "write manifest": ("schemas.format", "write_manifest"),
    "versions": ("precompute.job", "software_versions"),
}


@contextlib.contextmanager
def phase_timer(totals: dict):
    """Add each phase's seconds to totals; a phase called inside another counts for the outer one only."""
    import importlib

    saved, active = [], []
    for phase, (mod_name, path) in PHASES.items():
        mod = importlib.import_module(mod_name)
        *owners, attr = path.split(".")  # "Checkpoint.load_model": a method, patched on its class
        for owner in owners:
            mod = getattr(mod, owner)
        fn = getattr(mod, attr)

        def timed(*a, _fn=fn, _phase=phase, **kw):
            if active:
                return _fn(*a, **kw)
            active.append(_phase)
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                common.sync()
                totals[_phase] = totals.get(_phase, 0.0) + time.perf_counter() - t
                active.pop()

        saved.append((mod, attr, fn))
        setattr(mod, attr, timed)
    try:
        yield totals
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)


# the four ways of scoring

def bare_batches(model_dir, data, split, encoding, token_budget, rows_per_shard, dev):
    """The padded batches score_pairs forms (per shard, length-sorted, same token budget), built once."""
    from runtime.data import encode_rows, load_rows
    from runtime.checkpoint import load_tokenizer
    from runtime.packing import length_batches
    from runtime.logprobs import pad_sequences

    tok = load_tokenizer(str(model_dir))
    encoded = encode_rows(load_rows(str(data), split), tok, encoding)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    batches = []
    for start in range(0, len(encoded.pairs), rows_per_shard):
        pairs = encoded.pairs[start : start + rows_per_shard]
        seqs = [p.prompt_ids + c for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
        for b in length_batches([len(s) for s in seqs], token_budget):
            batches.append(pad_sequences([seqs[i] for i in b], pad_id, dev))
    return encoded, pad_id, batches


def trl_precompute(model_dir, rows, max_length: int, pairs_per_batch: int, dev, out: Path, counts: dict):
    """TRL's reference precompute as a user runs it: load the model, construct DPOTrainer(precompute_ref_log_probs).
    Fills counts with TRL's own token count and the time inside its _precompute_ref_logps."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=common.torch_dtype(dev)).to(dev)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ds = datasets.Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    args = DPOConfig(
        output_dir=str(out), precompute_ref_log_probs=True, precompute_ref_batch_size=pairs_per_batch,
        per_device_train_batch_size=pairs_per_batch, max_length=max_length, use_cpu=dev.type == "cpu",
        bf16=dev.type == "cuda", fp16=False, gradient_checkpointing=False, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_strategy="no",
    )
    inner = DPOTrainer._precompute_ref_logps

    def timed(self, *a, **kw):
        t = time.perf_counter()
        try:
            return inner(self, *a, **kw)
        finally:
            common.sync()
            counts["precompute_s"] = time.perf_counter() - t

    DPOTrainer._precompute_ref_logps = timed
    try:
        trainer = DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    finally:
        DPOTrainer._precompute_ref_logps = inner
    cols = trainer.train_dataset
    counts["tokens"] = sum(2 * len(p) + len(c) + len(r) for p, c, r in
                           zip(cols["prompt_ids"], cols["chosen_ids"], cols["rejected_ids"]))
    del trainer, model


def bench_case(case: dict, work: Path, dev) -> dict:
    from precompute.job import PrecomputeConfig, run_precompute
    from precompute.modes import score_pairs
    from runtime.checkpoint import Checkpoint

    model_dir, data, split, encoding = prepare(case, work)
    budget, rows_per_shard = PrecomputeConfig.token_budget, PrecomputeConfig.rows_per_shard
    encoded, pad_id, batches = bare_batches(model_dir, data, split, encoding, budget, rows_per_shard, dev)
    model = Checkpoint.open(str(model_dir)).load_model(common.torch_dtype(dev), dev, "sdpa")
    tokens = sum(int(m.sum()) for _, m in batches)
    slots = sum(m.numel() for _, m in batches)
    longest = max(ids.shape[1] for ids, _ in batches)

    out = work / f"cache-{case['name'].replace('@', '-').replace('/', '')}"
    last, phases = {}, []

    def refcache():
        shutil.rmtree(out, ignore_errors=True)
        totals = {}
        with phase_timer(totals):
            t = time.perf_counter()
            last.update(run_precompute(PrecomputeConfig(model=str(model_dir), data=str(data), out=str(out),
                                                        split=split, encoding=encoding, progress=False),
                                       log=lambda m: None))
            totals["total"] = time.perf_counter() - t
        phases.append(totals)

    def score_only(mode=None):  # the batching mode run_precompute chose (known after its warm-up run)
        for start in range(0, len(encoded.pairs), rows_per_shard):
            score_pairs(model, encoded.pairs[start : start + rows_per_shard], pad_id, budget, mode or last["mode"])

    @torch.no_grad()
    def bare():
        for ids, mask in batches:
            model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    fns = {"refcache": refcache, "score_only": score_only, "bare": bare}
    refcache()  # the warm-up run, which also tells the batching mode it picks
    if last["mode"] != "full_forward":  # then time full_forward beside it
        fns["score_full_forward"] = lambda: score_only("full_forward")
    trl_counts = {}
    if case.get("trl") and common.has_trl():
        rows = [json.loads(l) for l in (Path(data) / "train.jsonl" if Path(data).is_dir() else Path(data))
                .read_text().splitlines() if l.strip()]
        pairs_per_batch = max(1, budget // (2 * longest))
        fns["trl"] = lambda: trl_precompute(model_dir, rows, encoding.max_length, pairs_per_batch, dev,
                                            work / "trl-out", trl_counts)
    for name, fn in fns.items():  # warm up the others
        if name != "refcache":
            fn()
    phases.clear()
    times = measure.interleaved(fns, reps=case["reps"], warmup=0)

    phase_median = {k: common.statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]}
    named = sum(v for k, v in phase_median.items() if k != "total")
    phase_median["other"] = max(0.0, phase_median["total"] - named)
    r = {
        "case": case["name"], "model": case["model"] if case["model"] != "data" else "data/sft-model",
        "params": common.n_params(model), "seq_len": case.get("seq"), "longest": longest, "pairs": len(encoded.pairs),
        "tokens": tokens, "completion_tokens": sum(len(p.chosen_ids) + len(p.rejected_ids) for p in encoded.pairs),
        "padding_fraction": 1 - tokens / slots, "batches": len(batches), "token_budget": budget, "times": times,
        "tokens_per_s": {k: tokens / v["median"] for k, v in times.items()}, "phases_s": phase_median,
        "cache_bytes": last.get("bytes"), "bytes_per_completion_token": last.get("bytes_per_completion_token"),
        "ratio_refcache_vs_bare": measure.ratio(times["bare"], times["refcache"]),
        "ratio_score_vs_bare": measure.ratio(times["bare"], times["score_only"]), "mode": last["mode"],
        "refcache_padding_fraction": last.get("padding_fraction"),  # of the rows run_precompute actually ran
        "ratio_refcache_compute_vs_bare": measure.ratio(times["bare"], phase_median["forward+gather"]),
        "headline": bool(case.get("headline")),
    }
    if case.get("headline") and r["ratio_refcache_vs_bare"] < 0.9:  # a missed target: where does the time go?
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            refcache()
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        r["profile"] = prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=48)
    if "trl" in times:
        r["ratio_refcache_vs_trl"] = measure.ratio(times["trl"], times["refcache"])
        r["trl_tokens"] = trl_counts.get("tokens")
        r["trl_precompute_only_s"] = trl_counts.get("precompute_s")
    shutil.rmtree(out, ignore_errors=True)
    return r


# peak memory of one precompute run, in a process of its own

def child_peak(model_dir: str, data: str, split: str, max_length: int, out: str) -> dict:
    common.quiet()
    import datasets, transformers, pyarrow.parquet  # noqa: F401,E401  (imports are not part of the job's peak)
    measure.reset_peak()
    base = measure.rss_mb()
    res = common.precompute(model_dir, data, out, max_length, split=split)
    weights = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors")) / 2**20
    return {"peak_rss_mb": measure.peak_rss_mb(), "baseline_rss_mb": base, "maxrss_mb": measure.maxrss_mb(),
            "cuda_peak_mb": measure.cuda_peak_mb(), "weights_mb": weights, "tokens_per_s": res["tokens_per_s"]}


def peak_memory(case: dict, work: Path) -> dict:
    model_dir, data, split, encoding = prepare(case, work)
    out = work / "peak-cache"
    shutil.rmtree(out, ignore_errors=True)
    r = common.run_child(common.child_argv(__file__, "peak", model=model_dir, data=data, split=split,
                                           seq=encoding.max_length, out=out))
    shutil.rmtree(out, ignore_errors=True)
    return {"case": case["name"], **r}


def main():
    args = common.child_parser(__doc__, ["peak"], paths=("model", "data", "split", "out"), ints=("seq",)).parse_args()
    if args.child:
        print(json.dumps(child_peak(args.model, args.data, args.split, args.seq, args.out)))
        return
    common.quiet()
    dev = common.device()
    results, peaks = [], []
    with common.workdir("precompute") as work:
        for case in cases(args.quick, dev):
            t = time.perf_counter()
            r = bench_case(case, work, dev)
            results.append(r)
            trl = f", trl {r['ratio_refcache_vs_trl']:.2f}x" if "ratio_refcache_vs_trl" in r else ""
            ff = (f", full_forward/bare {measure.ratio(r['times']['bare'], r['times']['score_full_forward']):.2f}x"
                  if "score_full_forward" in r["times"] else "")
            print(f"{r['case']:<10} {r['tokens']:>7} tok  pad {r['padding_fraction']:.1%}  mode {r['mode']}  "
                  f"refcache {r['tokens_per_s']['refcache']:,.0f} tok/s  bare {r['tokens_per_s']['bare']:,.0f}  "
                  f"e2e/bare {r['ratio_refcache_vs_bare']:.2f}x  score/bare {r['ratio_score_vs_bare']:.2f}x{ff}{trl}"
                  f"  [{time.perf_counter() - t:.0f} s]", flush=True)
        for case in cases(args.quick, dev):
            if case["model"] == "data" or case.get("headline"):
                peaks.append(peak_memory(case, work))
                p = peaks[-1]
                print(f"peak memory {p['case']}: {p['peak_rss_mb']:.0f} MiB RSS (baseline after imports "
                      f"{p['baseline_rss_mb']:.0f} MiB, weights {p['weights_mb']:.1f} MiB)", flush=True)
    path = common.save("precompute", {"cases": results, "peak_memory": peaks}, args)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
