"""The whole job a user runs: a sweep of 3 betas, each run a separate process started as a user starts it.

  refcache  `python -m precompute.cli` once, then `python -m dpo.cli --ref-cache` once per beta on that cache
  trl       `python bench/sweep_trl.py` once per beta: trl.DPOTrainer with precompute_ref_log_probs=True and no
            ref_model, TRL's faster mode (its reference log-probs computed in every run)

Per process: wall time and CPU time (getrusage of the child); the train loop as the run records it (refcache:
run-manifest.json result.train_s; TRL: the script's own clock); the fixed cost (wall minus loop) split by the phases
each run records. Runs are interleaved (precompute, ours beta0, TRL beta0, ...), after one untimed `dpo.cli --help`
(what an installation computes once, as for a user's sweep).

    .venv/bin/python bench/bench_sweep.py [--quick]
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import common

FULL = dict(model="5M", pairs=256, batch=4, seq=256, steps=60, betas=(0.1, 0.3, 0.5))
QUICK = dict(model="5M", pairs=48, batch=4, seq=128, steps=6, betas=(0.1, 0.3, 0.5))
GROUPS = {  # fixed-cost phases as reported, from the phases each run records
    "refcache": {"start-up/imports": ("startup", "imports", "checks"), "verification": ("verify",),
                 "model load": ("load",), "layout probe": ("layout",), "trainer setup": ("setup",),
                 "save": ("save",), "plot": ("plot",), "final hash": ("final_hash", "manifest")},
    "trl": {"start-up/imports": ("startup",), "model load": ("load",),
            "data + TRL reference precompute": ("setup",), "save": ("save",)},
}


def timed(cmd: list[str], out: Path, log) -> dict:
    """Run a command (output to out.log): common.run_process's figures and the load average around it."""
    before = os.getloadavg()[0]
    r = common.run_process(cmd, out.parent / f"{out.name}.log")
    r["loadavg"] = [round(before, 2), round(os.getloadavg()[0], 2)]
    log(f"  {r['wall_s']:6.1f} s wall {r['cpu_s']:6.1f} s CPU  load {r['loadavg'][0]:.2f} -> {r['loadavg'][1]:.2f}  "
        f"{' '.join(Path(c).name if '/' in c else c for c in cmd[1:4])} ...")
    return r


def precompute_job_s(log_file: Path) -> float | None:
    """precompute-ref's own wall time of the job (its summary's `wall:`, from reading the data to the manifest): the
    rest of the process wall is its start-up (interpreter, imports) and exit."""
    found = re.search(r"\bwall: ([0-9.]+) s", log_file.read_text())
    return float(found.group(1)) if found else None


def fixed_cost(side: str, run: dict) -> dict:
    """Process wall minus loop, split by the recorded phases; `other`: what no phase covers (exit, output)."""
    phases = run["phases"]
    split = {name: sum(phases[p]["wall_s"] or 0 for p in keys if p in phases)
             for name, keys in GROUPS[side].items()}
    split_cpu = {name: sum(phases[p]["cpu_s"] for p in keys if p in phases) for name, keys in GROUPS[side].items()}
    fixed = run["wall_s"] - run["loop_s"]
    split["other"] = fixed - sum(split.values())
    return {"fixed_s": fixed, "wall_s": split, "cpu_s": split_cpu}


def run_ours(size: dict, model: Path, data: Path, cache: Path, out: Path, beta: float, log) -> dict:
    cmd = [sys.executable, "-m", "dpo.cli", "--model", str(model), "--data", str(data), "--ref-cache", str(cache),
           "--output-dir", str(out), "--beta", str(beta), "--max-steps", str(size["steps"]),
           "--per-device-train-batch-size", str(size["batch"])]
    r = timed(cmd, out, log)
    result = json.loads((out / "run-manifest.json").read_text())["result"]
    r.update(loop_s=result["train_s"], phases=result["phases"], steps=result["steps"],
             batch_layout=result["batch_layout"])
    return r | {"fixed": fixed_cost("refcache", r)}


def run_trl(size: dict, model: Path, data: Path, out: Path, beta: float, log) -> dict:
    """sweep_trl.py, TRL's run as a user writes it."""
    phases = out.with_suffix(".json")
    cmd = [sys.executable, str(common.BENCH / "sweep_trl.py"), str(model), str(data), str(out), str(beta),
           str(size["steps"]), str(size["batch"]), str(size["seq"]), str(phases)]
    r = timed(cmd, out, log)
    rec = json.loads(phases.read_text())
    r.update(loop_s=rec["phases"]["train"]["wall_s"], setup_s=rec["phases"]["setup"]["wall_s"], phases=rec["phases"],
             train_runtime=rec["train_runtime"], train_loss=rec["train_loss"], steps=rec["steps"])
    return r | {"fixed": fixed_cost("trl", r)}


def precompute(size: dict, model: Path, data: Path, cache: Path, log) -> dict:
    """precompute-ref as a user runs it, once for the sweep."""
    log("precompute-ref")
    return timed([sys.executable, "-m", "precompute.cli", "--model", str(model), "--data", str(data), "--out",
                  str(cache), "--max-length", str(size["seq"]), "--no-progress"], cache, log)


def sweep(size: dict, work: Path, log) -> dict:
    model, data = common.synthetic_case(work, size["model"], size["pairs"], size["seq"], seed=3)
    cache = work / "cache"
    # Once per installation, untimed: train-dpo's table of TrainingArguments options (dpo/trainer_options.py) is
    # computed and stored the first time after an install or a change of its code, as the .pyc files are; a user's
    # sweep finds them made. `--help` makes both.
    common.run_process([sys.executable, "-m", "dpo.cli", "--help"], work / "help.log")
    pre = precompute(size, model, data, cache, log)
    pre["job_s"] = precompute_job_s(cache.parent / f"{cache.name}.log")
    ours, trl = [], []
    for beta in size["betas"]:  # interleaved: ours, then TRL, per beta
        log(f"beta {beta}: train-dpo, then TRL")
        ours.append(run_ours(size, model, data, cache, work / f"ours-{beta}", beta, log))
        trl.append(run_trl(size, model, data, work / f"trl-{beta}", beta, log))
    total_ours = pre["wall_s"] + sum(r["wall_s"] for r in ours)
    total_trl = sum(r["wall_s"] for r in trl)
    loops = (sum(r["loop_s"] for r in ours), sum(r["loop_s"] for r in trl))
    return {
        "precompute": pre, "refcache": ours, "trl": trl,
        "total_wall_s": {"refcache": total_ours, "trl": total_trl},
        "total_cpu_s": {"refcache": pre["cpu_s"] + sum(r["cpu_s"] for r in ours),
                        "trl": sum(r["cpu_s"] for r in trl)},
        "ratio_wall": total_ours / total_trl, "ratio_loop": loops[0] / loops[1],
        "ratio_cpu": (pre["cpu_s"] + sum(r["cpu_s"] for r in ours)) / sum(r["cpu_s"] for r in trl),
        "fixed_mean_s": {"refcache": sum(r["fixed"]["fixed_s"] for r in ours) / len(ours),
                         "trl": sum(r["fixed"]["fixed_s"] for r in trl) / len(trl)},
    }


def report(res: dict, log) -> None:
    log(f"total wall: refcache {res['total_wall_s']['refcache']:.1f} s (precompute {res['precompute']['wall_s']:.1f} s"
        f" + 3 train-dpo), TRL {res['total_wall_s']['trl']:.1f} s -> {res['ratio_wall']:.3f}x (goal <= 0.45x); "
        f"train loops alone {res['ratio_loop']:.3f}x; CPU {res['ratio_cpu']:.3f}x")
    pre = res["precompute"]
    if pre.get("job_s") is not None:
        log(f"  precompute wall {pre['wall_s']:.1f} s = job {pre['job_s']:.1f} s + start-up and exit "
            f"{pre['wall_s'] - pre['job_s']:.1f} s")
    for side in ("refcache", "trl"):
        for r in res[side]:
            f = r["fixed"]
            parts = ", ".join(f"{k} {v:.2f}" for k, v in f["wall_s"].items())
            log(f"  {side:<8} wall {r['wall_s']:.1f} s = loop {r['loop_s']:.1f} s + fixed {f['fixed_s']:.1f} s "
                f"({parts}); load {r['loadavg'][0]:.2f} -> {r['loadavg'][1]:.2f}")


def main():
    args = common.parser(__doc__).parse_args()
    size = QUICK if args.quick else FULL
    log = lambda m: print(m, flush=True)
    with common.workdir("sweep") as work:
        res = sweep(size, work, log)
    report(res, log)
    res["size"] = {**size, "params": common.n_params(common.build_llama(size["model"]))}
    print(f"wrote {common.save('sweep', res, args)}")


if __name__ == "__main__":
    main()
