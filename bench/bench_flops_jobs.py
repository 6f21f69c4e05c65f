"""Part 11b: precompute-ref's useful FLOP/s share on a short job (24 pairs) and one 10x longer (240; the short job is
its first rows), with `--torch-compile` auto (the default), eager and compiled with a warm inductor cache, side by
side (issue 39), on part 11's 35M long-prompt case with part 11's useful FLOPs.

Each run is a child process, as a user's job is: it times the matmul (torch.mm 2048^3, MM_REPS times), runs
run_precompute once (wall and CPU seconds; the interpreter's start and imports apart, `startup_s`), then the matmul
again, and records the 1-minute load average around its job. Rounds interleave every job and variant (the order
turning each round). The share's denominator is the best matmul of the whole run; `share_own`, the child's own best.

Compile figures: first one `--torch-compile` run of the short job with an empty inductor cache (`cold`); from the
medians, per-pair and fixed seconds (the two jobs' difference), eager and compiled: the speed-up, compiling's cost
(warm, and cold) and the break-even job. `profile` (unless --no-profile): one child runs the short job twice with auto
under flops_profile.phase_profile, a fresh process's job and the same job again.

    .venv/bin/python bench/bench_flops_jobs.py [--quick] [--rounds 2] [--short 24] [--long 240] [--no-profile]
"""

from __future__ import annotations

import json
import os
import re
import statistics
import shutil
import time
from pathlib import Path

import common
from common import torch
from flops_count import MM_FLOPS, encoded_pairs, forward_flops, long_prompt_rows, mm_fn, model_shape, pair_lengths

VARIANTS = {"auto": None, "eager": False, "compiled_warm": True}  # name -> PrecomputeConfig.torch_compile
MM_REPS = 5
CASE = dict(model="35M", prompt=512, completion=128, seq=1024)


def startup_seconds() -> float:
    """Seconds from this process's start to now (the interpreter, the imports)."""
    ticks = os.sysconf("SC_CLK_TCK")
    start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    return float(Path("/proc/uptime").read_text().split()[0]) - start


def mm_times(mm, reps: int = MM_REPS) -> dict:
    """The matmul's wall and CPU seconds, `reps` times after one unrecorded call."""
    mm()
    wall, cpu = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        mm()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return {"wall": wall, "cpu": cpu}


def child_job(a) -> dict:
    """One run_precompute of the job in variant `a.variant`, between two matmul timings."""
    startup = startup_seconds()
    from precompute.job import PrecomputeConfig, run_precompute
    from schemas.encoding import EncodingConfig

    dev = common.device()
    mm = mm_fn(common.torch_dtype(dev), dev)
    before, load_before = mm_times(mm), os.getloadavg()[0]
    out, logs = Path(a.out), []
    shutil.rmtree(out, ignore_errors=True)
    t, c = time.perf_counter(), time.process_time()
    summary = run_precompute(PrecomputeConfig(model=a.model, data=a.data, out=str(out), progress=False,
                                              encoding=EncodingConfig(max_length=a.seq),
                                              torch_compile={"auto": None, "eager": False}.get(a.variant, True)),
                             log=logs.append)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    load_after = os.getloadavg()[0]
    after = mm_times(mm)
    computation = json.loads((out / "manifest.json").read_text())["computation"]
    return {"variant": a.variant, "wall_s": wall, "cpu_s": cpu, "startup_s": startup, "mode": summary["mode"],
            "mm": {k: before[k] + after[k] for k in before}, "loadavg": [round(load_before, 2), round(load_after, 2)],
            "compiled": bool(computation.get("compiled")), "log": [m for m in logs if "torch.compile" in m]}


def child_profile(a) -> dict:
    """The job with auto, twice in this process under the phase timer: a fresh process's job, then again."""
    startup = startup_seconds()
    from flops_profile import phase_profile
    from precompute.job import PrecomputeConfig, run_precompute
    from schemas.encoding import EncodingConfig

    out = Path(a.out)

    def run():
        shutil.rmtree(out, ignore_errors=True)
        run_precompute(PrecomputeConfig(model=a.model, data=a.data, out=str(out), progress=False,
                                        encoding=EncodingConfig(max_length=a.seq)), log=lambda m: None)

    return {"startup_s": startup, "first": phase_profile(run), "again": phase_profile(run),
            "loadavg": round(os.getloadavg()[0], 2)}


def prepare(work: Path, short: int, long: int) -> dict:
    model = common.make_checkpoint(work, CASE["model"])
    rows = long_prompt_rows(long, common.MODELS[CASE["model"]]["vocab"], CASE["prompt"], CASE["completion"])
    data = {"short": common.write_jsonl(work / "short" / "train.jsonl", rows[:short]),
            "long": common.write_jsonl(work / "long" / "train.jsonl", rows)}
    return {"model": model, "data": data}


def job_flops(model: Path, data: Path) -> dict:
    """Useful forward FLOPs of the job's pairs as precompute-ref encodes them."""
    from runtime.checkpoint import Checkpoint

    class Args:
        seq = CASE["seq"]

    Args.model, Args.data = str(model), str(data)
    _, pairs, _ = encoded_pairs(Args)
    shape = model_shape(Checkpoint.open(model).load_model(torch.float32, torch.device("cpu"), "sdpa"))
    return {"pairs": len(pairs), **forward_flops(shape, pair_lengths(pairs))}


def median(values):
    return statistics.median(values)


def summarize(runs: dict, flops: dict, cold: dict | None) -> dict:
    """runs: {(job, variant): [child results]} -> shares against the run's best matmul, times, compile figures."""
    every = [r for rs in runs.values() for r in rs] + ([cold] if cold else [])
    best_wall = min(v for r in every for v in r["mm"]["wall"])
    best_cpu = min(v for r in every for v in r["mm"]["cpu"])
    mm_rate, mm_rate_cpu = MM_FLOPS / best_wall, MM_FLOPS / best_cpu
    out = {"mm": {"best_wall_s": best_wall, "best_cpu_s": best_cpu, "flops_per_s": mm_rate,
                  "flops_per_cpu_s": mm_rate_cpu, "measures": sum(len(r["mm"]["wall"]) for r in every),
                  "median_wall_s": median([v for r in every for v in r["mm"]["wall"]])},
           "jobs": {}}
    for (job, variant), rs in runs.items():
        total = flops[job]["total"]
        wall, cpu = [r["wall_s"] for r in rs], [r["cpu_s"] for r in rs]
        out["jobs"].setdefault(job, {"pairs": flops[job]["pairs"], "flops": flops[job], "variants": {}})
        out["jobs"][job]["variants"][variant] = {
            "wall_s": wall, "cpu_s": cpu, "median_wall_s": median(wall), "median_cpu_s": median(cpu),
            "share": total / median(wall) / mm_rate, "share_best": total / min(wall) / mm_rate,
            "share_cpu": total / median(cpu) / mm_rate_cpu,
            "share_own": median([total / r["wall_s"] / (MM_FLOPS / min(r["mm"]["wall"])) for r in rs]),
            "startup_s": median([r["startup_s"] for r in rs]), "loadavg": [r["loadavg"] for r in rs],
            "compiled": [r["compiled"] for r in rs], "mode": rs[0]["mode"], "log": rs[0]["log"]}
    for job, j in out["jobs"].items():
        v = j["variants"]
        if "auto" in v and "eager" in v:  # per round, then the median: the two ran back to back
            pairs = zip(runs[(job, "auto")], runs[(job, "eager")])
            j["auto_over_eager"] = median([x["wall_s"] / y["wall_s"] for x, y in pairs])
    out["compile"] = compile_figures(out["jobs"], cold)
    return out


def compile_figures(jobs: dict, cold: dict | None) -> dict | None:
    """Per-pair and fixed seconds (eager, compiled warm) from the jobs' medians; speed-up, cost, break-even."""
    if not all(j in jobs and {"eager", "compiled_warm"} <= set(jobs[j]["variants"]) for j in ("short", "long")):
        return None
    n_short, n_long = jobs["short"]["pairs"], jobs["long"]["pairs"]
    fit = {}
    for v in ("eager", "compiled_warm"):
        t_short, t_long = (jobs[j]["variants"][v]["median_wall_s"] for j in ("short", "long"))
        per_pair = (t_long - t_short) / (n_long - n_short)
        fit[v] = {"per_pair_s": per_pair, "fixed_s": t_short - n_short * per_pair}
    e, c = fit["eager"], fit["compiled_warm"]
    warm_cost = c["fixed_s"] - e["fixed_s"]
    out = {"fit": fit, "speedup": e["per_pair_s"] / c["per_pair_s"], "compile_warm_s": warm_cost}
    if cold is not None:  # the cold run is the short job: its extra over the warm median is the cold cache's
        out["cold_wall_s"] = cold["wall_s"]
        out["compile_cold_s"] = warm_cost + cold["wall_s"] - jobs["short"]["variants"]["compiled_warm"]["median_wall_s"]
    saving = e["per_pair_s"] - c["per_pair_s"]
    for kind in ("warm", "cold"):
        cost = out.get(f"compile_{kind}_s")
        if cost is not None:
            pairs = cost / saving if saving > 0 else None
            out[f"break_even_{kind}"] = {"pairs": pairs, "eager_scoring_s": pairs * e["per_pair_s"] if pairs else None}
    return out


def measure_all(a) -> dict:
    """Every child of the run, in order; what has come so far is kept in the --raw file after each one."""
    short, long = (4, 24) if a.quick else (a.short, a.long)
    rounds = 1 if a.quick else a.rounds
    raw_path = a.raw or Path(common.tempfile.gettempdir()) / f"flops-jobs-raw-{os.getpid()}.json"
    print(f"each child's result goes to {raw_path} as it comes", flush=True)
    with common.workdir("flops-jobs") as work:
        p = prepare(work, short, long)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor")  # this run's own: empty until the cold run
        raw = {"size": {**CASE, "short": short, "long": long, "rounds": rounds, "mm_reps": MM_REPS},
               "flops": {job: job_flops(p["model"], p["data"][job]) for job in ("short", "long")}, "cold": None,
               "runs": [], "profile": None, "threads": torch.get_num_threads()}

        def argv(child, job, variant=None):
            return common.child_argv(__file__, child, model=p["model"], data=p["data"][job], seq=CASE["seq"],
                                     out=work / "out" / job, variant=variant)

        def keep():
            raw["loadavg_end"], raw["wall_s"] = round(os.getloadavg()[0], 2), time.perf_counter() - t
            raw_path.write_text(json.dumps(raw, default=float))

        t = time.perf_counter()
        raw["cold"] = common.run_child(argv("job", "short", "compiled_warm"))  # the empty cache: compiles cold
        keep()
        print(f"cold compile run, short job: {raw['cold']['wall_s']:.1f} s (compiled: {raw['cold']['compiled']})",
              flush=True)
        names = list(VARIANTS)
        for i in range(rounds):
            order = names[i % len(names):] + names[: i % len(names)]
            for job in ("short", "long"):
                for variant in order:
                    r = common.run_child(argv("job", job, variant))
                    raw["runs"].append([job, variant, r])
                    keep()
                    print(f"round {i} {job} {variant:<13} {r['wall_s']:6.1f} s wall {r['cpu_s']:6.1f} s CPU, mm best "
                          f"{min(r['mm']['wall']) * 1e3:.0f} ms, load {r['loadavg']}", flush=True)
        if not a.no_profile:
            raw["profile"] = common.run_child(argv("profile", "short"))
        keep()
    return raw


def main():
    ap = common.child_parser(__doc__, ("job", "profile"))
    ap.add_argument("--variant", choices=tuple(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--short", type=int, default=24, help="pairs in the short job")
    ap.add_argument("--long", type=int, default=240, help="pairs in the long job")
    ap.add_argument("--no-profile", action="store_true", help="skip the phase tables of the short job")
    ap.add_argument("--raw", type=Path, help="keep every child's result in this JSON file as it comes (default: "
                                             "a file in the temporary folder, named when the run starts)")
    ap.add_argument("--from-raw", type=Path, help="no runs: the results from a --raw file of an earlier run")
    a = ap.parse_args()
    if a.child:
        common.quiet()
        r = child_job(a) if a.child == "job" else child_profile(a)
        print(json.dumps(r, default=float))
        return
    common.quiet()
    raw = json.loads(a.from_raw.read_text()) if a.from_raw else measure_all(a)
    runs = {}
    for job, variant, r in raw["runs"]:
        runs.setdefault((job, variant), []).append(r)
    raw["size"]["rounds_done"] = max(map(len, runs.values()), default=0)  # fewer than asked where a run was cut short
    result = {"case": f"35M long prompt ({CASE['prompt']} + {CASE['completion']}/{CASE['completion']})",
              "size": raw["size"], **summarize(runs, raw["flops"], raw["cold"]), "cold": raw["cold"],
              "profile": raw["profile"], "threads": raw["threads"], "loadavg_end": raw["loadavg_end"],
              "wall_s": raw["wall_s"]}
    for job, j in result["jobs"].items():
        print(f"{job} ({j['pairs']} pairs): " + ", ".join(f"{v} {x['share']:.2f} (CPU {x['share_cpu']:.2f})"
                                                          for v, x in j["variants"].items())
              + (f"; auto/eager {j['auto_over_eager']:.3f}" if "auto_over_eager" in j else ""))
    if result["compile"]:
        print("compile: " + re.sub(r"\s+", " ", json.dumps(result["compile"], default=lambda v: round(v, 3))))
    path = common.save("flops-jobs", result, a)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
