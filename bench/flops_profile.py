"""Part 11's tables of where the time goes (bench_flops.py): run_precompute's phases, the body's matmuls at their
own shapes, and torch.profiler's top ops."""

from __future__ import annotations

import time

import measure
from common import torch
from flops_count import MM_FLOPS, mm_fn

# where run_precompute's time goes

PHASES = {  # label -> the (module, attribute) names it is called through; nested calls are their own phases
    "load rows": [("precompute.prepare", "load_rows")],
    "encode rows": [("precompute.prepare", "usable_rows")],
    "load model": [("runtime.checkpoint", "Checkpoint.load_model")],
    "head check": [("precompute.job", "verified_head"), ("runtime.logprobs", "verified_head")],
    "mode choice": [("precompute.job", "choose_mode")],
    "probe: reference forwards": [("precompute.modes.choose", "reference_values")],
    "probe: mode forwards": [("precompute.modes.choose", "mode_values")],
    "score_pairs": [("precompute.job", "score_known"), ("precompute.modes.choose", "score_pairs")],
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
