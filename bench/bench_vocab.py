"""Part 12: a 128k vocabulary (Llama 3's 128,256) at sequence 2048: peak memory and time of precompute-ref and of a
train-dpo step, against TRL's DPOTrainer with `precompute_ref_log_probs=True` and with a live reference.

The model has a small body (hidden 64, 2 layers) so that it runs on 2 CPU cores: its weights are almost all
embeddings and the head over 128k logits is most of the work, as for a large vocabulary on any model. Synthetic
pairs of 1,024 to 2,048 tokens. Each configuration (CONFIGS) runs in a process of its own (peak RSS: VmHWM), one
round each (`--rounds` for more); `_keep` forces the head to `logits_to_keep` (the model's own head for the scored
positions); trl_precompute is TRL's faster mode (its reference pass in __init__). Targets: ours peak <= 0.5x
trl_precompute's; precompute peak <= weights + 1 GiB.

    nice .venv/bin/python bench/bench_vocab.py [--quick] [--configs a,b] [--reuse]

--configs runs only those configurations; with --reuse the saved rounds of the others (same size) are kept.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import common
import measure
import train_steps

SPEC = dict(hidden=64, layers=2, heads=2, kv=1, inter=192, vocab=128256)
FULL = dict(model="128k", seq=2048, batch=2, warmup=1, steps=2, pairs=6, rounds=1)
QUICK = dict(model="128k", seq=2048, batch=1, warmup=1, steps=1, pairs=2, rounds=1)
CONFIGS = ("precompute", "precompute_keep", "ours", "ours_keep", "trl_precompute", "trl_live")


def force_head(head: str) -> None:
    """Every head decision in this process returns `head` (the path a model with post-processed logits takes)."""
    import precompute.job as job
    import runtime.logprobs as logprobs

    logprobs.verified_head = job.verified_head = lambda model: head


def child_precompute(a, head: str | None) -> dict:
    common.quiet()
    import datasets, transformers, pyarrow.parquet  # noqa: F401,E401  (imports are not part of the job's peak)
    if head:
        force_head(head)
    base = measure.rss_mb()
    t = time.perf_counter()
    res = common.precompute(a.model, a.data, Path(a.out) / f"cache-{a.child}", a.seq)
    wall = time.perf_counter() - t
    weights = sum(p.stat().st_size for p in Path(a.model).glob("*.safetensors")) / 2**20
    return {"mode": a.child, "maxrss_mb": measure.maxrss_mb(), "baseline_rss_mb": base, "weights_mb": weights,
            "wall_s": wall, "tokens": res["tokens"], "batching": res.get("mode"), "loadavg": common.os.getloadavg()[0]}


def run_keep(a, timer, out):
    force_head("logits_to_keep")
    return train_steps.run_ours(a, "cached", timer, out)


RUNNERS = {
    "ours": lambda a, timer, out: train_steps.run_ours(a, "cached", timer, out),
    "ours_keep": run_keep,
    "trl_precompute": lambda a, timer, out: train_steps.run_trl(a, timer, out, live_reference=False,
                                                                precompute_ref_log_probs=True),
    "trl_live": lambda a, timer, out: train_steps.run_trl(a, timer, out),
}


def scored_per_step(model: Path, data: Path, size: dict) -> int:
    """The most completion tokens any `batch` pairs hold: the logits a forward through the own head keeps."""
    from runtime.checkpoint import load_tokenizer
    from runtime.data import encode_rows, load_rows
    from schemas.encoding import EncodingConfig

    pairs = encode_rows(load_rows(str(data), "train"), load_tokenizer(str(model)),
                        EncodingConfig(max_length=size["seq"])).pairs
    return sum(sorted((len(p.chosen_ids) + len(p.rejected_ids) for p in pairs), reverse=True)[: size["batch"]])


def main():
    ap = common.child_parser(__doc__, CONFIGS)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--profile", type=int, default=0, help="1: torch.profiler on ours and trl_precompute")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--reuse", action="store_true", help="keep the saved rounds (same size) of configurations not run")
    a = ap.parse_args()
    if a.child:
        if a.child.startswith("precompute"):
            r = child_precompute(a, "logits_to_keep" if a.child == "precompute_keep" else None)
        else:
            r = train_steps.child(a, RUNNERS, imports=("trl",) if a.child.startswith("trl") else ())
            r["loadavg"] = common.os.getloadavg()[0]
        print(json.dumps(r, default=float))
        return
    common.quiet()
    size = dict(QUICK if a.quick else FULL)
    size["rounds"] = a.rounds or size["rounds"]
    configs = [c for c in a.configs.split(",") if c]
    with common.workdir("vocab") as work:
        model = common.make_checkpoint(work, "128k", spec=SPEC)
        rows = common.synthetic_pairs(size["pairs"], size["seq"], SPEC["vocab"], seed=3)
        data = common.write_jsonl(work / "data" / "train.jsonl", rows)
        t = time.perf_counter()
        cache = work / "cache"
        info = common.precompute(model, data, cache, size["seq"])
        scored = scored_per_step(model, data, size)
        print(f"cache: {info['tokens']:,} tokens in {time.perf_counter() - t:.0f} s", flush=True)

        def argv(mode):
            return common.child_argv(__file__, mode, model=model, data=data, cache=cache, seq=size["seq"],
                                     batch=size["batch"], warmup=size["warmup"], steps=size["steps"], out=work / "runs",
                                     profile=1 if a.profile and mode in ("ours", "trl_precompute") else None)

        show = lambda r: (f"peak {r['maxrss_mb']:.0f} MiB, " + (f"wall {r['wall_s']:.1f} s" if "wall_s" in r else
                          f"steps {' '.join(f'{v:.1f}' for v in r['step_s'])} s") + f", load {r['loadavg']:.1f}")
        runs = common.rounds(size["rounds"], configs, argv, show=show)
    saved = common.result_path("vocab", a.quick, a.results)
    if a.reuse and saved.exists() and json.loads(saved.read_text())["size"] == size:
        kept = json.loads(saved.read_text())["runs"]
        runs = {**{m: r["rounds"] for m, r in kept.items() if m not in runs}, **runs}
        runs = {m: runs[m] for m in CONFIGS if m in runs}
    weights_mb = runs["precompute"][0]["weights_mb"] if "precompute" in runs else None
    res = {"size": size, "spec": SPEC, "params": common.n_params(common.build_llama(SPEC)), "weights_mb": weights_mb,
           "tokens": info["tokens"], "scored_per_step_max": scored, "runs": {}}
    for mode, rs in runs.items():
        if mode.startswith("precompute"):
            res["runs"][mode] = {"mode": mode, "maxrss": measure.stats([r["maxrss_mb"] for r in rs]),
                                 "wall": measure.stats([r["wall_s"] for r in rs]), "rounds": rs,
                                 "baseline_rss_mb": rs[0]["baseline_rss_mb"]}
        else:
            res["runs"][mode] = train_steps.summarize(rs)
        res["runs"][mode]["maxrss_mb"] = res["runs"][mode]["maxrss"]["median"]
    R = res["runs"]
    if "ours" in R and "trl_precompute" in R:
        res["ours_vs_trl_precompute"] = R["ours"]["maxrss_mb"] / R["trl_precompute"]["maxrss_mb"]
    if "precompute" in R:
        res["precompute_over_weights_mb"] = R["precompute"]["maxrss_mb"] - weights_mb
    path = common.save("vocab", res, a)
    for mode, r in R.items():
        t = common.fmt_s(r["wall"]) if "wall" in r else common.fmt_s(r["step"], "ms", 1000) + " per step"
        print(f"{mode:<16} peak RSS {r['maxrss_mb']:,.0f} MiB  {t}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
