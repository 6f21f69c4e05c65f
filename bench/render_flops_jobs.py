"""Part 11b's section of the page (bench_flops_jobs.py: precompute-ref's share on a short and a long job, with
--torch-compile auto, eager and compiled warm) and its target figures."""

from __future__ import annotations

from report import table

NAMES = {"auto": "auto (the default)", "eager": "eager (--no-torch-compile)",
         "compiled_warm": "--torch-compile, warm inductor cache"}


def figures(J: dict) -> dict:
    """The figures the targets judge: {key: (value, where)}."""
    out, jobs = {}, J.get("jobs", {})
    where = f"{J['case']}, %d pairs"
    if "auto" in jobs.get("long", {}).get("variants", {}):
        out["flops_jobs_long_auto"] = (jobs["long"]["variants"]["auto"]["share"], where % jobs["long"]["pairs"])
    if "auto" in jobs.get("short", {}).get("variants", {}):
        out["flops_jobs_short_auto"] = (jobs["short"]["variants"]["auto"]["share"], where % jobs["short"]["pairs"])
    if "auto_over_eager" in jobs.get("short", {}):
        out["auto_vs_eager_short_job"] = (jobs["short"]["auto_over_eager"], where % jobs["short"]["pairs"])
    return out


def _times(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values) + " s"


def render_flops_jobs(J: dict) -> list[str]:
    mm = J["mm"]
    rows = []
    for job in ("short", "long"):
        if job not in J["jobs"]:
            continue
        j = J["jobs"][job]
        for name, v in j["variants"].items():
            rows.append([f"{j['pairs']} pairs ({j['flops']['total'] / 1e9:,.0f} GFLOPs)", NAMES.get(name, name),
                         _times(v["wall_s"]), f"**{v['share']:.2f}**", f"{v['share_best']:.2f}",
                         f"{v['share_cpu']:.2f}", f"{v['share_own']:.2f}",
                         f"{sum(v['compiled'])}/{len(v['compiled'])}", " / ".join(f"{a}-{b}" for a, b in v["loadavg"])])
    L = [f"{J['case']}, precompute-ref (run_precompute, one child process per run, as a user's job: load, probe, "
         "compile where it does, scoring, writing; the interpreter's start and imports not included) on a job of "
         f"{J['size']['short']} pairs and one of {J['size']['long']}, {J['size'].get('rounds_done', J['size']['rounds'])} round(s) interleaving every "
         f"job and variant, {J['threads']} torch threads (`python bench/bench_flops_jobs.py`). Useful FLOPs are part "
         "11's. The denominator is the best of the run's "
         f"{mm['measures']} matmul measures (torch.mm 2048^3, every child before and after its job): "
         f"{mm['flops_per_s'] / 1e9:,.1f} GFLOP/s (their median {2 * 2048**3 / mm['median_wall_s'] / 1e9:,.1f}). "
         "Share: on the median time; best: on the fastest round; in CPU seconds: the process's own CPU time against "
         "the best matmul's; own: against the child's own best matmul. **These 2 cores are shared with other "
         "processes**: the load column is the 1-minute load average before and after each run (above 2, others "
         "competed for the cores); the absolute times and the shares on them are pulled down by it, the ratios "
         "between variants much less (interleaved).", ""]
    L += table("job | variant | wall per round | share | share, best round | in CPU s | own mm | compiled | load",
               rows)
    L.append("")
    for job in ("short", "long"):
        j = J["jobs"].get(job, {})
        if "auto_over_eager" in j:
            auto = j["variants"]["auto"]
            L.append(f"- {j['pairs']} pairs: auto's wall over eager's, per round then the median: "
                     f"**{j['auto_over_eager']:.3f}x**; auto's choice: {auto['log'][-1] if auto['log'] else '-'}")
    c = J.get("compile")
    if c:
        e, w = c["fit"]["eager"], c["fit"]["compiled_warm"]
        be = c.get("break_even_warm", {}).get("pairs")
        bc = c.get("break_even_cold", {}).get("pairs")
        L.append(f"- Compile, measured: per pair {e['per_pair_s']:.3f} s eager, {w['per_pair_s']:.3f} s compiled "
                 f"(**{c['speedup']:.2f}x**); fixed {e['fixed_s']:.1f} s eager, {w['fixed_s']:.1f} s compiled warm, "
                 f"so compiling costs **{c['compile_warm_s']:.1f} s warm**"
                 + (f" and **{c['compile_cold_s']:.1f} s cold** (the cold run of the short job: {c['cold_wall_s']:.1f} s)"
                    if "compile_cold_s" in c else "")
                 + "; break-even: " + (f"{be:,.0f} pairs warm ({c['break_even_warm']['eager_scoring_s'] / 60:,.0f} min "
                                       "of eager scoring)" if be else "never warm (compiled not faster per pair)")
                 + (f", {bc:,.0f} cold ({c['break_even_cold']['eager_scoring_s'] / 60:,.0f} min)" if bc
                    else ", never cold" if "compile_cold_s" in c else "")
                 + " (precompute/compiled.py's auto rule uses SPEEDUP and COMPILE_SECONDS: compare).")
    P = J.get("profile")
    if P:
        L += ["", f"Where the short job's fixed time goes: one child, the short job with auto twice under the phase "
              f"timer (part 11's phases; `other` is what no phase covers: checking the inputs, opening the "
              f"checkpoint, loading the tokenizer, the stamps, the lock, the card). The process's start and imports "
              f"before the job: {P['startup_s']:.1f} s. Load {P['loadavg']}.", ""]
        first, again = P["first"], P["again"]
        keys = sorted((k for k in first if k != "total"), key=lambda k: -first[k]["wall"])
        prow = [[k, f"{first[k]['wall']:.3f} s", f"{first[k]['cpu']:.3f} s",
                 f"{again[k]['wall']:.3f} s" if k in again else "-", f"{again[k]['cpu']:.3f} s" if k in again else "-"]
                for k in keys if first[k]["wall"] >= 0.005 or again.get(k, {}).get("wall", 0) >= 0.005]
        prow.append(["**total**", f"{first['total']['wall']:.3f} s", f"{first['total']['cpu']:.3f} s",
                     f"{again['total']['wall']:.3f} s", f"{again['total']['cpu']:.3f} s"])
        L += table("phase | first job in the process, wall | CPU | the same job again, wall | CPU", prow)
    return L
