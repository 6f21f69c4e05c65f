"""Part 11: useful FLOP/s, as a share of the machine's own dense matmul rate measured in the same process.

Useful FLOPs are counted from the encoded pairs (flops_count.forward_flops: each prompt once, each completion once,
no padding), never from what a layout runs: 2 x N_body per token, 2 x hidden x vocab per scored position (the head
where its output is used; `head_every_token` counts it at every token), and causal attention, 4 x heads x head_dim
per (query, key) pair per layer; a training step is 3 x its forward (the optimizer not counted). The matmul rate is
torch.mm of two 2048 x 2048 matrices in the model's dtype, timed in the same child, interleaved with the work (in
training once after every step, outside its time); every contender is also timed in its process's CPU seconds.

Children (CONFIGS), round-robin over rounds, on the 35M long-prompt case (prompt 512, completions 128/128), data/ and
(full mode) the long prompt's pairs in a job of 64:
  precompute    run_precompute end to end (`refcache`), score_pairs alone in the mode it picked (`score`), and a
                plain padded HF forward of the same pairs (`padded_hf`), interleaved with mm
  train, train_padded  train-dpo's step (cached reference), batch_layout prefix_shared and padded
Where the time goes (`profile`, on the 35M case): run_precompute split by phase (flops_profile.phase_profile), the
body's matmuls at their own shapes, torch.profiler's top ops, and the step split at the Trainer's callbacks.

    .venv/bin/python bench/bench_flops.py [--quick] [--threads 1] [--cases long] [--configs precompute] [--no-profile]
        [--head-pieces 33554432]   further contenders: the CPU head in pieces of this many logits
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import common
import measure
from common import np, torch
from flops_count import (MM, MM_FLOPS, encoded_pairs, forward_flops, long_prompt_rows, matmul_check, mm_fn,  # noqa: F401
                         model_shape, pair_lengths)
from flops_profile import body_matmul_rate, phase_profile, profile_tables

CONFIGS = ("precompute", "train", "train_padded")


# the children

def child_precompute(a) -> dict:
    from precompute.job import PrecomputeConfig, run_precompute
    from precompute.modes import score_pairs
    from runtime.checkpoint import Checkpoint
    from runtime.logprobs import pad_sequences
    from runtime.packing import length_batches

    dev = common.device()
    encoding, pairs, pad_id = encoded_pairs(a)
    budget, per_shard = PrecomputeConfig.token_budget, PrecomputeConfig.rows_per_shard
    model = Checkpoint.open(a.model).load_model(common.torch_dtype(dev), dev, "sdpa")
    seqs = [p.prompt_ids + c for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
    batches = [pad_sequences([seqs[i] for i in b], pad_id, dev) for b in length_batches([len(s) for s in seqs], budget)]
    out, last = Path(a.out) / "cache", {}

    def refcache():
        shutil.rmtree(out, ignore_errors=True)
        last.update(run_precompute(PrecomputeConfig(model=a.model, data=a.data, out=str(out), encoding=encoding,
                                                    progress=False), log=lambda m: None))

    def score():
        for s in range(0, len(pairs), per_shard):
            score_pairs(model, pairs[s : s + per_shard], pad_id, budget, last["mode"])

    @torch.no_grad()
    def padded_hf():
        for ids, mask in batches:
            model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    refcache()  # warm-up; tells the mode
    fns = {"mm": mm_fn(common.torch_dtype(dev), dev), "refcache": refcache, "score": score, "padded_hf": padded_hf,
           **variants(a, model, pairs, pad_id, per_shard, last["mode"], refcache)}
    cpu = {}
    with torch.no_grad():
        times = measure.interleaved(fns, reps=a.reps, warmup=1, cpu=cpu)
    shape = model_shape(model)
    flops = forward_flops(shape, pair_lengths(pairs))
    tokens = sum(int(m.sum()) for _, m in batches)
    slots = sum(m.numel() for _, m in batches)
    r = {"matmul_check": matmul_check(model, pairs[0]), "mode": last["mode"], "pairs": len(pairs), "shape": shape,
         "flops": flops, "times": times, "cpu_times": cpu, "threads": torch.get_num_threads(),
         "padded_hf_padding_fraction": 1 - tokens / slots, "refcache_padding_fraction": last.get("padding_fraction")}
    if a.profile:
        r["body_matmuls"] = body_matmul_rate(model)
        r["phases"] = phase_profile(refcache)
        tables = profile_tables(score)
        r["profile"], r["profile_shapes"] = tables["ops"], tables["shapes"]
    return r


def variants(a, model, pairs, pad_id: int, per_shard: int, mode: str, refcache) -> dict:
    """Further contenders (--head-pieces): `score/head piece E` and `refcache/head piece E`, score_pairs and
    run_precompute with the CPU head's pieces at E logits (runtime.logprobs.CPU_CHUNK_ELEMENTS; 2**25 is the memory
    chunk itself, the head before it ran in pieces)."""
    from precompute.job import PrecomputeConfig
    from precompute.modes import score_pairs
    from runtime import logprobs

    def pieces(piece: int, fn):
        def run():
            saved = logprobs.CPU_CHUNK_ELEMENTS
            logprobs.CPU_CHUNK_ELEMENTS = piece
            try:
                fn()
            finally:
                logprobs.CPU_CHUNK_ELEMENTS = saved
        return run

    def scored():
        for s in range(0, len(pairs), per_shard):
            score_pairs(model, pairs[s : s + per_shard], pad_id, PrecomputeConfig.token_budget, mode)

    pieces_at = [int(x) for x in a.head_pieces.split(",") if x.strip()] if a.head_pieces else []
    return {**{f"score/head piece {e}": pieces(e, scored) for e in pieces_at},
            **{f"refcache/head piece {e}": pieces(e, refcache) for e in pieces_at}}


def child_train(a, layout: str, **overrides) -> dict:
    """One train-dpo run (cached reference) in `layout`; `overrides`: further TrainConfig fields (training_args)."""
    import train_steps
    from dpo import layout as L, trainer as T

    seen = []  # the lengths of every collated batch, in order (the loader collates one ahead of the step)
    for cls in (L.PrefixSharedCollator, T.PairCollator):
        orig = cls.__call__

        def call(self, rows, _orig=orig):
            seen.append([[len(r["prompt_ids"]), len(r["chosen_ids"]), len(r["rejected_ids"])] for r in rows])
            return _orig(self, rows)

        cls.__call__ = call
    dev = common.device()
    mm, mm_s, mm_cpu, step_cpu = mm_fn(common.torch_dtype(dev), dev), [], [], []
    marks, segments = [], []  # (event, wall, cpu) within the current step; each step's segments
    profile = None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        profile = torch_profile(activities=[ProfilerActivity.CPU])
    timer = train_steps.step_timer(profile, a.steps + a.warmup - 1)  # the last step only: the others stay unprofiled
    timed_end = timer.on_step_end

    def mark(event):
        common.sync()
        marks.append((event, time.perf_counter(), time.process_time()))

    def on_step_end(args, state, control, **kw):
        mark("end")
        timed_end(args, state, control, **kw)
        step_cpu.append(marks[-1][2] - marks[0][2])
        segments.append({f"{a[0]}>{b[0]}": (b[1] - a[1], b[2] - a[2]) for a, b in zip(marks, marks[1:])})
        mm()  # one unrecorded call, then the timed one
        common.sync()
        t, c = time.perf_counter(), time.process_time()
        mm()
        common.sync()
        mm_s.append(time.perf_counter() - t)
        mm_cpu.append(time.process_time() - c)
        timer.last = time.perf_counter()  # the next step's time starts after the matmul
        marks[:] = [("start", timer.last, time.process_time())]

    timer.on_step_end = on_step_end
    for event in ("step_begin", "pre_optimizer_step", "optimizer_step"):
        setattr(timer, f"on_{event}", lambda args, state, control, _e=event, **kw: mark(_e))
    begin = timer.on_train_begin

    def on_train_begin(*args, **kw):
        seen.clear()  # the layout probe collates a batch of its own before training
        begin(*args, **kw)
        marks[:] = [("start", timer.last, time.process_time())]

    timer.on_train_begin = on_train_begin
    from runtime.checkpoint import Checkpoint

    shape = model_shape(Checkpoint.open(a.model).load_model(torch.float32, torch.device("cpu"), "sdpa"))
    train_steps.run_ours(a, "cached", timer, str(Path(a.out) / layout), batch_layout=layout, **overrides)
    steps = [forward_flops(shape, np.array(b)) for b in seen[: len(timer.step_s)]]
    table = (profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48)
             if profile is not None else None)
    return {"layout": layout, "shape": shape, "profile": table, "step_s": timer.step_s[a.warmup :], "mm_s": mm_s[a.warmup :],
            "step_cpu_s": step_cpu[a.warmup :], "mm_cpu_s": mm_cpu[a.warmup :], "segments": segments[a.warmup :],
            "threads": torch.get_num_threads(), "warmup_step_s": timer.step_s[: a.warmup],
            "step_flops": [3 * f["total"] for f in steps[a.warmup :]],
            "step_flops_head_every_token": [3 * f["head_every_token"] for f in steps[a.warmup :]],
            "maxrss_mb": timer.maxrss_mb}


# the parent

def cases(quick: bool) -> list[dict]:
    return [
        dict(name="35M long prompt (512 + 128/128)", model="35M", prompt=512, completion=128,
             pairs=4 if quick else 8, batch=2, warmup=1, steps=2 if quick else 3, seq=1024, reps=2 if quick else 3),
        dict(name="data/", model="data", batch=8, warmup=1, steps=3 if quick else 6, reps=2 if quick else 4),
    ] + ([] if quick else [
        # the same pairs in a job of 64: precompute-ref's fixed costs (load, the batching-mode probe, hashing) are
        # per job, so their weight in the end-to-end share depends on the job's size; precompute only, no profile
        dict(name="35M long prompt, a job of 64 pairs", key="job", model="35M", prompt=512, completion=128, pairs=64,
             batch=2, warmup=1, steps=3, seq=1024, reps=1, configs=("precompute",), no_profile=True),
    ])


def prepare(case: dict, work: Path) -> dict:
    """model, data (precompute's), train data (one epoch of the train steps) and its cache."""
    if case["model"] == "data":
        model, data = common.sft_data()
        return {"model": model, "data": data, "train_data": data, "cache": work / "cache-data", "seq": None}
    model = common.make_checkpoint(work, case["model"])
    vocab = common.MODELS[case["model"]]["vocab"]
    n_train = case["batch"] * (case["warmup"] + case["steps"])
    rows = long_prompt_rows(max(case["pairs"], n_train), vocab, case["prompt"], case["completion"])
    key = case.get("key", "long")
    data = common.write_jsonl(work / key / "train.jsonl", rows[: case["pairs"]])
    train = common.write_jsonl(work / f"{key}-train" / "train.jsonl", rows[:n_train])
    return {"model": model, "data": data, "train_data": train, "cache": work / f"cache-{key}", "seq": case["seq"]}


def summarize(case: dict, runs: dict) -> dict:
    out = {"case": case["name"], "size": case, "loadavg": {k: [r["loadavg"] for r in rs] for k, rs in runs.items()}}
    if runs.get("precompute"):
        rs = runs["precompute"]
        flops = rs[0]["flops"]
        pooled = {k: [v for r in rs for v in r["times"][k]["values"]] for k in rs[0]["times"]}
        mm_rate = MM_FLOPS / common.statistics.median(pooled["mm"])
        rate = {k: flops["total"] / common.statistics.median(v) for k, v in pooled.items() if k != "mm"}
        # per round: each contender's share of that process's own matmul rate, then the median over rounds
        share = {k: common.statistics.median(flops["total"] / r["times"][k]["median"] / (MM_FLOPS / r["times"]["mm"]["median"])
                                             for r in rs) for k in rate}
        cpu_share = {k: common.statistics.median(flops["total"] / r["cpu_times"][k]["median"]
                                                 / (MM_FLOPS / r["cpu_times"]["mm"]["median"]) for r in rs)
                     for k in rate}
        first = ("matmul_check", "mode", "pairs", "shape", "threads", "phases", "profile_shapes", "body_matmuls",
                 "padded_hf_padding_fraction", "refcache_padding_fraction", "profile", "attention_calls")
        out["precompute"] = {**{k: rs[0].get(k) for k in first}, "flops": flops, "share_of_mm_cpu": cpu_share,
                             "cpu_times": {k: measure.stats([v for r in rs for v in r["cpu_times"][k]["values"]])
                                           for k in pooled},
                             "times": {k: measure.stats(v) for k, v in pooled.items()}, "mm_flops_per_s": mm_rate,
                             "useful_flops_per_s": rate, "share_of_mm": share,
                             "share_of_mm_head_every_token": {k: v * flops["head_every_token"] / flops["total"]
                                                              for k, v in share.items()}}
    for layout in ("train", "train_padded"):
        if runs.get(layout):
            rs = runs[layout]
            step_s, flops, every, mm_s, step_cpu, mm_cpu, segments = (
                [v for r in rs for v in r[k]] for k in ("step_s", "step_flops", "step_flops_head_every_token", "mm_s",
                                                         "step_cpu_s", "mm_cpu_s", "segments"))
            mm_rate = MM_FLOPS / common.statistics.median(mm_s)
            rates = [f / s for f, s in zip(flops, step_s)]
            names = list(segments[0]) if segments else []
            out[layout] = {"layout": rs[0]["layout"], "shape": rs[0]["shape"], "step": measure.stats(step_s),
                           "mm": measure.stats(mm_s), "mm_flops_per_s": mm_rate, "step_flops": measure.stats(flops),
                           "useful_flops_per_s": common.statistics.median(rates),
                           "share_of_mm": common.statistics.median(rates) / mm_rate,
                           "share_of_mm_head_every_token": common.statistics.median(
                               [f / s for f, s in zip(every, step_s)]) / mm_rate,
                           "maxrss_mb": common.statistics.median(r["maxrss_mb"] for r in rs),
                           "threads": rs[0]["threads"], "step_cpu": measure.stats(step_cpu), "mm_cpu": measure.stats(mm_cpu),
                           "share_of_mm_cpu": common.statistics.median([f / c for f, c in zip(flops, step_cpu)])
                           / (MM_FLOPS / common.statistics.median(mm_cpu)),
                           "segments": {n: {"wall": common.statistics.median(g[n][0] for g in segments if n in g),
                                            "cpu": common.statistics.median(g[n][1] for g in segments if n in g)}
                                        for n in names},
                           "profile": rs[0].get("profile")}
    return out


def main():
    ap = common.child_parser(__doc__, CONFIGS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads in every child (default: torch's own)")
    ap.add_argument("--head-pieces", help="also time score_pairs with the CPU head's pieces at these numbers of logits "
                                          "(comma-separated; 33554432 = the memory chunk, no pieces)")
    ap.add_argument("--no-profile", action="store_true", help="skip the phase tables and torch.profiler runs")
    ap.add_argument("--cases", default="long,data,job", help="which cases: long (35M long prompt), data (data/), "
                                                              "job (the long prompt's pairs in a job of 64, full mode)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"which children ({', '.join(CONFIGS)})")
    a = ap.parse_args()
    if a.child:
        common.quiet()
        if a.threads:
            torch.set_num_threads(a.threads)
        r = child_precompute(a) if a.child == "precompute" else child_train(a, {"train": "prefix_shared",
                                                                                "train_padded": "padded"}[a.child])
        print(json.dumps({"config": a.child, "loadavg": round(common.os.getloadavg()[0], 2), **r}, default=float))
        return
    common.quiet()
    results = []
    with common.workdir("flops") as work:
        for case in cases(a.quick):
            if case.get("key", "data" if case["model"] == "data" else "long") not in a.cases.split(","):
                continue
            t = time.perf_counter()
            p = prepare(case, work)
            common.precompute(p["model"], p["train_data"], p["cache"], p["seq"])
            configs = [c for c in (CONFIGS[:2] if a.quick else CONFIGS) if c in a.configs.split(",")
                       and c in case.get("configs", CONFIGS)]

            def argv(mode, p=p, case=case):
                data = p["data"] if mode == "precompute" else p["train_data"]
                return common.child_argv(__file__, mode, model=p["model"], data=data, cache=p["cache"], seq=p["seq"],
                                         batch=case["batch"], warmup=case["warmup"], steps=case["steps"],
                                         out=work / "runs", reps=case["reps"], profile=int(case["model"] != "data" and not a.no_profile
                                                                    and not case.get("no_profile")),
                                         threads=a.threads or None, head_pieces=a.head_pieces)

            runs = common.rounds(1 if a.quick else 2, configs, argv, show=show)
            r = summarize(case, runs)
            r["loadavg_end"] = round(common.os.getloadavg()[0], 2)
            results.append(r)
            print(f"{case['name']}: {line(r)} [{time.perf_counter() - t:.0f} s]", flush=True)
    path = common.save("flops", {"cases": results, "threads": a.threads or torch.get_num_threads()}, a)
    print(f"wrote {path}")


def show(r: dict) -> str:
    if "times" in r:
        return " ".join(f"{k} {v['median']:.2f}s" for k, v in r["times"].items()) + f" load {r['loadavg']}"
    return f"steps {' '.join(f'{v:.2f}' for v in r['step_s'])} s, mm {' '.join(f'{v:.3f}' for v in r['mm_s'])} s" \
           f" load {r['loadavg']}"


def line(r: dict) -> str:
    parts = []
    if "precompute" in r:
        parts.append("precompute share of mm: " + ", ".join(f"{k} {v:.2f}" for k, v in r["precompute"]["share_of_mm"]
                                                              .items()))
        parts.append("in CPU seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in r["precompute"]["share_of_mm_cpu"]
                                                      .items()))
    for layout in ("train", "train_padded"):
        if layout in r:
            parts.append(f"{layout} step {r[layout]['share_of_mm']:.2f} (CPU seconds {r[layout]['share_of_mm_cpu']:.2f})")
    return "; ".join(parts)


if __name__ == "__main__":
    main()
