"""Timing and memory for the parts: median/min/max of repeated runs (interleaved when comparing), RSS now and at
peak (process-wide, from /proc), CUDA peaks."""

from __future__ import annotations

import contextlib
import gc
import re
import resource
import statistics
import time
from pathlib import Path

import torch

from common import sync


def stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "values": [round(v, 6) for v in values]}


def timeit(fn, reps: int = 3, warmup: int = 1) -> dict:
    """Median/min/max seconds of `fn()` over `reps` runs after `warmup` unrecorded runs."""
    return interleaved({"fn": fn}, reps, warmup)["fn"]


def interleaved(fns: dict, reps: int = 3, warmup: int = 1, cpu: dict | None = None) -> dict:
    """Like timeit for several functions, run round-robin (a, b, c, a, b, c, ...) so that load from other
    processes on a shared machine falls on all of them alike. `cpu`, a dict: filled with the same statistics of
    the process's CPU seconds (all its threads) per call, which other processes inflate far less than wall time."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
            sync()
    times, cpus = {k: [] for k in fns}, {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            gc.collect()
            sync()
            t, c = time.perf_counter(), time.process_time()
            fn()
            sync()
            times[k].append(time.perf_counter() - t)
            cpus[k].append(time.process_time() - c)
    if cpu is not None:
        cpu.update({k: stats(v) for k, v in cpus.items()})
    return {k: stats(v) for k, v in times.items()}


@contextlib.contextmanager
def threads(n: int):
    """torch on `n` threads inside the block, as many as before after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ratio(a: dict | float, b: dict | float) -> float:
    """Ratio of two medians (or plain numbers)."""
    a = a["median"] if isinstance(a, dict) else a
    b = b["median"] if isinstance(b, dict) else b
    return a / b if b else float("nan")


# memory. CPU: resident set size from /proc (VmHWM is the peak; writing 5 to /proc/self/clear_refs resets it).
# CUDA: the caching allocator's own peak.

def _status_kb(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1))


def rss_mb() -> float:
    return _status_kb("VmRSS") / 1024


def rss_parts_mb() -> dict:
    """Resident memory by kind: anonymous (heap, tensors), file-backed (mapped files: libraries, mmap'ed weights)."""
    return {k: _status_kb(k) / 1024 for k in ("RssAnon", "RssFile", "RssShmem")}


def peak_rss_mb() -> float:
    """Peak RSS since the last reset_peak() (or process start)."""
    try:
        return _status_kb("VmHWM") / 1024
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_peak_before_reset_mb = 0.0  # the largest VmHWM read just before a reset_peak()


def maxrss_mb() -> float:
    """Peak RSS of this process since it started, never reset. From VmHWM (kept across reset_peak() calls), not
    getrusage: Linux carries ru_maxrss across fork and exec, so a child started by a parent that held 1 GiB would
    report at least 1 GiB whatever it used itself."""
    try:
        return max(_peak_before_reset_mb, _status_kb("VmHWM") / 1024)
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> bool:
    """Reset the peak RSS counter (and the CUDA peak); False where the kernel refuses."""
    global _peak_before_reset_mb
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        _peak_before_reset_mb = max(_peak_before_reset_mb, _status_kb("VmHWM") / 1024)
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def cuda_peak_mb() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
