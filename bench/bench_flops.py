"""Part 11: useful FLOP/s, as a share of the machine's own dense matmul rate measured in the same process.

Useful FLOPs are those of the work itself, counted from the encoded pairs (each prompt once, each completion once,
no padding), never from what a layout runs:
  forward   2 * N_body per token (N_body: every weight matrix except the input and output embeddings)
            + 2 * hidden * vocab per scored position (the head's matmul, only where its output is used: one position
              per completion token; `head_every_token` in the JSON counts it at every token instead)
            + attention, 4 * heads * head_dim per (query, key) pair per layer (QK^T and the weighted sum), causal
              within each sequence: prompt token i sees i keys, completion token j sees prompt + j keys
  train     3 x forward (the backward is twice the forward), the optimizer step not counted.
The matmul rate is torch.mm of two 2048 x 2048 matrices in the model's dtype (2 * 2048^3 FLOPs), timed in the same
child process, interleaved with the measured work (round-robin between the contenders; in training, once after every
step, outside the step's time).

Configurations, each in a child process of its own, round-robin over rounds (common.rounds), on two cases: the 35M
long-prompt case (prompt 512, completions 128/128, the shape of bench_modes' long-prompt case) and data/:
  precompute    run_precompute end to end (`refcache`), score_pairs alone in the mode it picked (`score`), and a
                plain padded Hugging Face forward of the same pairs (`padded_hf`: length-sorted padded batches of
                both sequences of every pair, the same token budget, `.logits` at every position), interleaved with mm
  train         train-dpo's step (cached reference, batch_layout prefix_shared), step time as in train_steps
  train_padded  the same with batch_layout padded (every prompt twice, padding)

Every contender is also timed in CPU seconds of its process (time.process_time, all its threads), beside the wall
time: on a shared machine other processes inflate wall time far more than CPU time, so the share in CPU seconds
(work and matmul each in their own CPU seconds) is the steadier figure. `--threads 1` runs every child on one torch
thread (the matmul too), the setting where CPU seconds are least disturbed by the other processes.

Where the time goes (`profile`, on the 35M case): one more run_precompute after the timed ones, its wall and CPU
seconds split by phase (each phase's own time, nested phases taken out: load, encode, model load, the head check,
the batching-mode probe's reference forwards and its mode forwards, the scoring's model forwards, the head
(projection + log-softmax), score_pairs' own Python, the shard table, the Parquet write and its hash, the manifest),
the model hash beside it (a background thread that overlaps the phases), torch.profiler's top ops of score_pairs by
self time and by input shape; for training the step split by the Trainer's callbacks (batch fetch and collation,
forward + backward + gradient clipping, optimizer step, scheduler and zeroing the gradients).

    .venv/bin/python bench/bench_flops.py [--quick] [--threads 1]
        [--budgets 1536,3072] [--head-pieces 33554432]   further score_pairs contenders, side by side
        [--attention 1]   torch's attention kernel on the case's shapes, with and without a mask
        [--cases long] [--configs precompute] [--no-profile]   a part of the runs only
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import common
import measure
from common import np, torch

MM = 2048
CONFIGS = ("precompute", "train", "train_padded")


# ---------------------------------------------------------------------------------------------------------------
# counting

def model_shape(model) -> dict:
    cfg = model.config
    emb_in, emb_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    embeddings = {p.data_ptr(): p.numel() for p in (emb_in, emb_out)}
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)  # norms' vectors are no matmul
    return {"n_body": matrices - sum(embeddings.values()), "hidden": emb_out.shape[1],
            "vocab": emb_out.shape[0], "layers": cfg.num_hidden_layers, "attn_width": heads * head_dim}


def forward_flops(shape: dict, lengths: np.ndarray) -> dict:
    """Useful forward FLOPs of pairs with lengths [n, 3] (prompt, chosen, rejected), by part (see the docstring)."""
    P, C, R = (lengths[:, i].astype(np.float64) for i in range(3))
    tokens = P + C + R
    keys = P * (P + 1) / 2 + sum(X * P + X * (X + 1) / 2 for X in (C, R))
    head = 2 * shape["hidden"] * shape["vocab"]
    out = {"body": 2 * shape["n_body"] * tokens.sum(), "head": head * (C + R).sum(),
           "attention": 4 * shape["layers"] * shape["attn_width"] * keys.sum()}
    out["total"] = out["body"] + out["head"] + out["attention"]
    out["head_every_token"] = out["total"] - out["head"] + head * tokens.sum()
    return out


@torch.no_grad()
def matmul_check(model, pair) -> dict:
    """The matmul FLOPs torch's own FlopCounterMode counts in a forward over one unpadded sequence (prompt + chosen,
    logits at every position) against this count's body + head at every token: an independent check of N."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.as_tensor([pair.prompt_ids + pair.chosen_ids], device=next(model.parameters()).device)
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=False)
    counted = sum(v for k, v in counter.get_flop_counts()["Global"].items() if "mm" in str(k))
    f = forward_flops(model_shape(model), np.array([[len(pair.prompt_ids), len(pair.chosen_ids), 0]]))
    return {"flop_counter_matmuls": counted, "ours": f["head_every_token"] - f["attention"]}


def pair_lengths(pairs) -> np.ndarray:
    return np.array([[len(p.prompt_ids), len(p.chosen_ids), len(p.rejected_ids)] for p in pairs], dtype=np.int64)


def encoded_pairs(a) -> tuple:
    """The case's train pairs as precompute-ref encodes them: (encoding, pairs, pad id)."""
    from runtime.checkpoint import load_tokenizer
    from runtime.data import encode_rows, load_rows
    from schemas.encoding import EncodingConfig

    encoding = EncodingConfig(max_length=a.seq) if a.seq else EncodingConfig()
    tok = load_tokenizer(a.model)
    pairs = encode_rows(load_rows(a.data, "train"), tok, encoding).pairs
    return encoding, pairs, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def mm_fn(dtype, dev):
    a = torch.randn(MM, MM, dtype=dtype, device=dev)
    b = torch.randn(MM, MM, dtype=dtype, device=dev)
    return lambda: torch.mm(a, b)


MM_FLOPS = 2 * MM**3


# ---------------------------------------------------------------------------------------------------------------
# where run_precompute's time goes

PHASES = {  # label -> the (module, attribute) names it is called through; nested calls are their own phases
    "load rows": [("precompute.prepare", "load_rows")],
    "encode rows": [("precompute.prepare", "usable_rows")],
    "load model": [("runtime.checkpoint", "Checkpoint.load_model")],
    "head check": [("precompute.job", "verified_head"), ("runtime.logprobs", "verified_head")],
    "mode choice": [("precompute.job", "choose_mode")],
    "probe: reference forwards": [("precompute.modes.choose", "reference_values")],
    "probe: mode forwards": [("precompute.modes.choose", "mode_values")],
    "score_pairs": [("precompute.job", "score_pairs"), ("precompute.modes.choose", "score_pairs")],
    "model forwards": [("runtime.logprobs", "token_scores")],  # the modes import it where they score
    "head (projection + log-softmax)": [("runtime.logprobs", "_chunk_scores")],
    "shard table": [("schemas.format", "shard_table")],
    "Parquet write": [("schemas.format", "write_shard")],
    "shard hash": [("schemas.format", "shard_entry")],
    "manifest, card": [("precompute.job", "_finish")],
}
BACKGROUND = {"model hash (background thread)": ("runtime.checkpoint", "model_hash")}


def _owner(mod_name: str, path: str):
    import importlib

    owner = importlib.import_module(mod_name)
    *parents, attr = path.split(".")
    for name in parents:
        owner = getattr(owner, name)
    return owner, attr


def phase_profile(run) -> dict:
    """run() under a timer of PHASES: {path: {"wall", "cpu"}} of each phase's own seconds (what its nested phases
    took is theirs; a path joins the enclosing phases with " / "), "other" (no phase), "total", and BACKGROUND's
    seconds (another thread, overlapping the rest)."""
    import threading

    main, stack, out, saved = threading.main_thread(), [], {}, []

    def timed(label, fn):
        def call(*a, **kw):
            if threading.current_thread() is not main:
                return fn(*a, **kw)
            stack.append([label, 0.0, 0.0])
            t, c = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                wall, cpu = time.perf_counter() - t, time.process_time() - c
                path = " / ".join(f[0] for f in stack)
                _, wall_in, cpu_in = stack.pop()
                got = out.setdefault(path, {"wall": 0.0, "cpu": 0.0, "calls": 0})
                got["wall"] += wall - wall_in
                got["cpu"] += cpu - cpu_in
                got["calls"] += 1
                if stack:
                    stack[-1][1] += wall
                    stack[-1][2] += cpu
        return call

    def background(label, fn):
        def call(*a, **kw):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                out[label] = {"wall": time.perf_counter() - t, "cpu": time.thread_time() - c, "background": True}
        return call

    for label, names in PHASES.items():
        for mod_name, path in names:
            owner, attr = _owner(mod_name, path)
            saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, timed(label, getattr(owner, attr)))
    for label, (mod_name, path) in BACKGROUND.items():
        owner, attr = _owner(mod_name, path)
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, background(label, getattr(owner, attr)))
    t, c = time.perf_counter(), time.process_time()
    try:
        run()
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)
    total = {"wall": time.perf_counter() - t, "cpu": time.process_time() - c}
    named = [v for v in out.values() if not v.get("background")]
    out["other"] = {k: max(0.0, total[k] - sum(v[k] for v in named)) for k in ("wall", "cpu")}
    out["total"] = total
    return out


@torch.no_grad()
def body_matmul_rate(model, tokens: int = 4096, reps: int = 3) -> dict:
    """The rate of the body's own matrix multiplies at their own shapes (each distinct weight of every layer's
    linear layers, applied to `tokens` rows, weighted by how many layers have it) against the 2048^3 matmul's, timed
    in CPU seconds side by side: the ceiling a forward of this model could reach if everything but its matmuls were
    free (attention and the elementwise work are what lies between it and the share measured)."""
    emb = {model.get_input_embeddings().weight.data_ptr(), model.get_output_embeddings().weight.data_ptr()}
    shapes = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.data_ptr() not in emb:
            shapes[tuple(module.weight.shape)] = shapes.get(tuple(module.weight.shape), 0) + 1
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    mm = mm_fn(dtype, dev)
    fns = {"mm": mm}
    for (out_f, in_f) in shapes:
        x, w = torch.randn(tokens, in_f, dtype=dtype, device=dev), torch.randn(out_f, in_f, dtype=dtype, device=dev)
        fns[f"{in_f}x{out_f}"] = lambda x=x, w=w: torch.nn.functional.linear(x, w)
    cpu = {}
    measure.interleaved(fns, reps=reps, warmup=1, cpu=cpu)
    mm_rate = MM_FLOPS / cpu["mm"]["median"]
    flops = {f"{i}x{o}": 2 * tokens * i * o * n for (o, i), n in shapes.items()}
    seconds = sum(f / (2 * tokens * int(k.split("x")[0]) * int(k.split("x")[1]) / cpu[k]["median"])
                  for k, f in flops.items())
    return {"tokens": tokens, "shapes": {k: {"layers": n, "share_of_mm": 2 * tokens * i * o / cpu[k]["median"] / mm_rate}
                                          for k, n, (o, i) in ((f"{i}x{o}", n, (o, i)) for (o, i), n in shapes.items())},
            "share_of_mm": sum(flops.values()) / seconds / mm_rate}


def profile_tables(fn) -> dict:
    """torch.profiler's top ops of fn() by self time, and by input shape."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, torch.no_grad():
        fn()
    return {"ops": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48),
            "shapes": prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cpu_time_total", row_limit=24, max_name_column_width=36, max_shapes_column_width=72)}


# ---------------------------------------------------------------------------------------------------------------
# the children

def child_precompute(a) -> dict:
    from precompute.job import PrecomputeConfig, run_precompute, score_pairs
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
    if a.attention:
        calls = {"mm": fns["mm"], **attention_calls(model, pairs)}
        cpu_calls = {}
        r["attention_calls"] = {"wall": measure.interleaved(calls, reps=a.reps + 2, warmup=1, cpu=cpu_calls),
                                "cpu": cpu_calls}
    if a.profile:
        r["body_matmuls"] = body_matmul_rate(model)
        r["phases"] = phase_profile(refcache)
        tables = profile_tables(score)
        r["profile"], r["profile_shapes"] = tables["ops"], tables["shapes"]
    return r


def variants(a, model, pairs, pad_id: int, per_shard: int, mode: str, refcache) -> dict:
    """Further contenders (--budgets, --head-pieces): `score@B`, score_pairs at token budget B; `score/head piece E`
    and `refcache/head piece E`, score_pairs and run_precompute with the CPU head's pieces at E logits
    (runtime.logprobs.CPU_CHUNK_ELEMENTS, at least CPU_CHUNK_ROWS positions; 2**25 is the memory chunk itself, the
    head before it ran in pieces)."""
    from precompute.job import PrecomputeConfig, score_pairs
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

    def scored(budget: int):
        def run():
            for s in range(0, len(pairs), per_shard):
                score_pairs(model, pairs[s : s + per_shard], pad_id, budget, mode)
        return run

    budget = PrecomputeConfig.token_budget
    return {**{f"score@{b}": scored(b) for b in numbers(a.budgets)},
            **{f"score/head piece {e}": pieces(e, scored(budget)) for e in numbers(a.head_pieces)},
            **{f"refcache/head piece {e}": pieces(e, refcache) for e in numbers(a.head_pieces)}}


def attention_calls(model, pairs, rows: int = 2) -> dict:
    """torch's attention kernel (scaled_dot_product_attention) on the case's own shapes, with and without an explicit
    mask, one call each (one layer): the kv_cache prompt pass (every prompt of the job in one batch, grouped-query
    heads as transformers passes them without a mask), its completion pass (keys and values repeated to every head
    as transformers does under a mask), and a training step's prefix_shared rows (forward + backward, `rows` rows of
    one pair each). `is_causal` and `no mask` are lower bounds where they give other numbers than the mask needs."""
    F = torch.nn.functional.scaled_dot_product_attention
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    n, P = len(pairs), max(len(p.prompt_ids) for p in pairs)
    C = max(max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs)
    r = lambda *shape, grad=False: torch.randn(*shape, requires_grad=grad)
    q, k, v = r(n, heads, P, d), r(n, kv, P, d), r(n, kv, P, d)
    tril = torch.ones(P, P, dtype=torch.bool).tril().expand(n, 1, P, P)
    q2, k2, v2 = r(2 * n, heads, C - 1, d), r(2 * n, heads, P + C - 1, d), r(2 * n, heads, P + C - 1, d)
    keys = torch.arange(P + C - 1)[None, :] <= P + torch.arange(C - 1)[:, None]
    keys = keys.expand(2 * n, 1, C - 1, P + C - 1)
    W = P + 2 * C
    q3, k3, v3 = r(rows, heads, W, d, grad=True), r(rows, heads, W, d, grad=True), r(rows, heads, W, d, grad=True)
    branch = torch.tensor([0] * P + [1] * C + [2] * C)
    pos = torch.cat([torch.arange(P + C), torch.arange(P, P + C)])
    tree = ((pos[None, :] <= pos[:, None]) & ((branch[None, :] == 0) | (branch[None, :] == branch[:, None])))
    tree = tree.expand(rows, 1, W, W)
    tree_float = torch.zeros(tree.shape).masked_fill_(~tree, torch.finfo(torch.float32).min)

    def train(**kw):
        return lambda: F(q3, k3, v3, **kw).sum().backward()

    return {f"prompt pass [{n}, {heads}, {P}, {d}], is_causal (what runs)": lambda: F(q, k, v, is_causal=True,
                                                                                  enable_gqa=True),
            "prompt pass, explicit causal mask": lambda: F(q, k, v, attn_mask=tril, enable_gqa=True),
            f"completion pass [{2 * n}, {heads}, {C - 1}, {d}] x {P + C - 1} keys, mask (what runs)":
                lambda: F(q2, k2, v2, attn_mask=keys),
            "completion pass, no mask (lower bound)": lambda: F(q2, k2, v2),
            f"train prefix_shared [{rows}, {heads}, {W}, {d}] fwd+bwd, float tree mask (what runs)":
                train(attn_mask=tree_float),
            "train, boolean tree mask": train(attn_mask=tree),
            "train, is_causal (lower bound)": train(is_causal=True)}


def numbers(text: str | None) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text else []


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


# ---------------------------------------------------------------------------------------------------------------
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


def long_prompt_rows(n: int, vocab: int, prompt: int, completion: int, seed: int = 0) -> list[dict]:
    """Pairs of exactly `prompt` prompt words and `completion` words per completion (EOS included), word tokenizer."""
    rng = np.random.default_rng(seed)
    words = lambda k: " ".join(f"w{i}" for i in rng.integers(3, vocab, size=k))
    return [{"id": f"p{i:04d}", "prompt": words(prompt), "chosen": " " + words(completion - 1),
             "rejected": " " + words(completion - 1)} for i in range(n)]


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
        out["precompute"] = {"matmul_check": rs[0].get("matmul_check"), "mode": rs[0]["mode"], "pairs": rs[0]["pairs"], "shape": rs[0]["shape"], "flops": flops,
                             "threads": rs[0]["threads"], "share_of_mm_cpu": cpu_share,
                             "cpu_times": {k: measure.stats([v for r in rs for v in r["cpu_times"][k]["values"]])
                                           for k in pooled},
                             "phases": rs[0].get("phases"), "profile_shapes": rs[0].get("profile_shapes"),
                             "body_matmuls": rs[0].get("body_matmuls"),
                             "times": {k: measure.stats(v) for k, v in pooled.items()}, "mm_flops_per_s": mm_rate,
                             "useful_flops_per_s": rate, "share_of_mm": share,
                             "share_of_mm_head_every_token": {k: v * flops["head_every_token"] / flops["total"]
                                                              for k, v in share.items()},
                             "padded_hf_padding_fraction": rs[0]["padded_hf_padding_fraction"],
                             "refcache_padding_fraction": rs[0]["refcache_padding_fraction"],
                             "profile": rs[0].get("profile"), "attention_calls": rs[0].get("attention_calls")}
    for layout in ("train", "train_padded"):
        if runs.get(layout):
            rs = runs[layout]
            step_s = [v for r in rs for v in r["step_s"]]
            flops = [v for r in rs for v in r["step_flops"]]
            every = [v for r in rs for v in r["step_flops_head_every_token"]]
            mm_s = [v for r in rs for v in r["mm_s"]]
            mm_rate = MM_FLOPS / common.statistics.median(mm_s)
            rates = [f / s for f, s in zip(flops, step_s)]
            step_cpu = [v for r in rs for v in r["step_cpu_s"]]
            mm_cpu = [v for r in rs for v in r["mm_cpu_s"]]
            segments = [seg for r in rs for seg in r["segments"]]
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
    ap.add_argument("--budgets", help="also time score_pairs at these token budgets (comma-separated), side by side")
    ap.add_argument("--head-pieces", help="also time score_pairs with the CPU head's pieces at these numbers of logits "
                                          "(comma-separated; 33554432 = the memory chunk, no pieces)")
    ap.add_argument("--attention", type=int, default=0, help="also time torch's attention kernel on the case's "
                                                                   "shapes, with and without an explicit mask")
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
                                         threads=a.threads or None, budgets=a.budgets, head_pieces=a.head_pieces,
                                         attention=a.attention or None)

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
