"""bench/RESULTS.md from the JSON results under bench/results/ (no measurement of its own; run_all.py calls it).

Per device: machine and load lines, targets, key figures, where the time goes for a missed target, then a section per
part with results (SECTIONS: part, title, renderer; a full run's results, else a quick run's, so marked). Last, the GPU
check, then the retired parts (bench/retired.md, static).
"""

from __future__ import annotations

import json
from pathlib import Path

import common
from render_cpu import (
    render_flops, render_memory, render_modes, render_offload, render_phases, render_precompute, render_size,
    render_store, render_sweep, render_train, render_update, render_verify,
)
from render_flops_jobs import render_flops_jobs
from render_figures import render_analysis, render_key_figures, render_targets
from render_profile import render_compile, render_topk, render_topk_train, render_vocab

RETIRED = common.BENCH / "retired.md"  # the last figures of the retired parts, kept as they were rendered
INTRO = common.BENCH / "page-intro.md"  # the page's opening: what it holds, the sizes, how to run
ORDER = ("precompute", "train", "verify", "size", "modes", "topk", "topk-train")  # machine and load lines: these parts


def load(results: Path, device: str) -> dict:
    out = {}
    for part in [*dict.fromkeys(p for p, _, _ in SECTIONS), "run"]:  # a full run's results, else a quick run's
        for path in (results / f"{part}-{device}.json", results / f"{part}-{device}-quick.json"):
            if path.exists():
                out[part] = json.loads(path.read_text())
                break
    return out


SECTIONS = [  # (part, title, renderer), in the order of RESULTS.md; parts 8 on run only when asked; the
    # numbers of the retired parts (4, 6, 15, 19) stay theirs: their sections are in RETIRED
    ("precompute", "1. Precompute throughput", render_precompute),
    ("precompute", "1b. Precompute phases (run_precompute, median over the timed passes)", render_phases),
    ("train", "2. Training step and peak memory", render_train),
    ("verify", "3. Verification and model hashing", render_verify),
    ("size", "5. Cache size", render_size),
    ("modes", "7. Precompute batching modes", render_modes),
    ("sweep", "8. The whole job: a sweep of 3 runs (bench_sweep.py)", render_sweep),
    ("memory", "9. Peak memory at the limit a cache allows (bench_memory.py)", render_memory),
    ("offload", "10. A reference split to disk (bench_offload.py)", render_offload),
    ("flops", "11. Useful FLOP/s against the machine's matmul rate (bench_flops.py)", render_flops),
    ("flops-jobs", "11b. Useful FLOP/s of precompute-ref on a short and a 10x longer job: --torch-compile auto, eager, "
                   "compiled warm (bench_flops_jobs.py)", render_flops_jobs),
    ("vocab", "12. A 128k vocabulary at sequence 2048 (bench_vocab.py)", render_vocab),
    ("topk", "13. Top-k cache: size and precompute time (bench_topk.py)", render_topk),
    ("topk-train", "14. Training step with a top-k cache: KL metrics, TDPO (bench_topk_train.py)", render_topk_train),
    ("compile", "16. torch.compile of the scoring forward and the training step (bench_compile.py)", render_compile),
    ("update", "17. precompute-ref --update adding 10% rows vs a full rerun (bench_update.py)", render_update),
    ("store", "18. A cache on an object store (local S3 server) vs local disk (bench_store.py)", render_store),
]


def render_device(R: dict) -> list[str]:
    run, L = R.get("run", {}), []
    m = next((R[p]["machine"] for p in ORDER if p in R), None)
    if m:
        loads = ", ".join(f"{p} {R[p].get('loadavg_start', '?')} -> {R[p]['machine'].get('loadavg_1min', '?')}"
                          for p in ORDER if p in R)
        L += [f"Machine: {common.machine_line(m)}", "", f"1-minute load average at the start and end of each part (2 "
              f"cores; above ~2 means other processes competed for them): {loads}.", ""]
    if run:
        walls = ", ".join(f"{k} {v:.0f} s" if v is not None else f"{k} FAILED" for k, v in run["walls"].items())
        L += [f"Produced by `{run['command']}` ({'quick' if run['quick'] else 'full'} mode) on {run['date']}; "
              f"total wall {run['total_s'] / 60:.1f} min ({walls}).", ""]
    L += ["### Targets", ""] + render_targets(R) + ["", "### Key figures", ""] + render_key_figures(R) + [""]
    analysis = render_analysis(R)
    if analysis:
        L += ["### Where the time goes (missed targets)", ""] + analysis + [""]
    for part, title, fn in SECTIONS:
        if part in R:
            L += [f"### {title}{' (quick mode)' if R[part].get('quick') else ''}", ""] + fn(R[part]) + [""]
    return L


def render(results: Path = common.RESULTS) -> str:
    L = [INTRO.read_text()]
    for device, title in (("cpu", "CPU"), ("cuda", "GPU")):
        R = load(Path(results), device)
        L.append(f"## {title}\n")
        if not any(p in R for p in ORDER):
            L.append("No results for this device yet" + (": run `bench/run_all.py` on a CUDA machine (device auto, "
                     "bf16, adds a ~350M model); the GPU results land here." if device == "cuda" else ".") + "\n")
            continue
        L += render_device(R)
    L += render_gpu_check(Path(results)) + ["", RETIRED.read_text().rstrip()]
    return "\n".join(L).rstrip() + "\n"


GPU_CHECK_RUN = """Run on one GPU: `bench/gpu_check.sh` (`bench/gpu_check.py` under an 8-minute limit; sized to take about
5 minutes on an H100/H200-class device, an estimate until it has run on one; `pip install flash-attn` adds the
flash_attention_2 row), then `bench/run_all.py --render-only` to put its tables here. What it measures and how is
in its docstring; `--cpu-smoke` runs the same code paths on CPU at tiny sizes (tests/bench/test_gpu_check.py runs
it)."""


def render_gpu_check(results: Path) -> list[str]:
    """The GPU check's section (bench/gpu_check.py): its tables from its CUDA result, else how to run it."""
    import gpu_check

    L = ["## GPU check", "", GPU_CHECK_RUN, ""]
    path = results / f"{gpu_check.PART}-cuda.json"
    if not path.exists():
        return L + ["It has not run on a GPU yet: none was lent to the session that wrote it (2026-12-02), so only its "
                    "CPU smoke run is known to work."]
    r = json.loads(path.read_text())
    return L + [f"Machine: {common.machine_line(r['machine'])}", ""] + gpu_check.tables(r)
