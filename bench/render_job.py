"""RESULTS.md sections of the whole-job parts: the sweep a user runs (bench_sweep.py) and peak memory at the limit a
cache allows (bench_memory.py). Used by run_all.py; these parts run only when asked (--parts sweep,memory)."""

from __future__ import annotations

EXTRA = {"sweep": "bench_sweep.py", "memory": "bench_memory.py"}


def _phase_table(runs: list[dict], label: str) -> list[str]:
    names = list(runs[0]["fixed"]["wall_s"])
    L = [f"| {label} run | process wall | loop | fixed | " + " | ".join(names) + " |",
         "|---" * (4 + len(names)) + "|"]
    for i, r in enumerate(runs):
        f = r["fixed"]
        L.append(f"| {i + 1} | {r['wall_s']:.1f} s | {r['loop_s']:.1f} s | {f['fixed_s']:.1f} s | "
                 + " | ".join(f"{f['wall_s'][n]:.2f} ({f['cpu_s'].get(n, 0):.2f})" if n in f["cpu_s"]
                              else f"{f['wall_s'][n]:.2f}" for n in names) + " |")
    return L


def render_sweep(S: dict) -> list[str]:
    size = S["size"]
    pre = S["precompute"]
    L = [f"{size['model']} model ({size['params'] / 1e6:.1f}M params), {size['pairs']} pairs, batch {size['batch']}, "
         f"max length {size['seq']}, betas {', '.join(map(str, size['betas']))} x {size['steps']} steps; every run a "
         "process of its own, started as a user starts it, interleaved (ours, then TRL, per beta). TRL: "
         "DPOTrainer with precompute_ref_log_probs=True and no ref_model (its faster mode; the reference log-probs "
         "are recomputed in every run).", "",
         f"- total wall: refcache **{S['total_wall_s']['refcache']:.1f} s** (precompute {pre['wall_s']:.1f} s + 3 "
         f"train-dpo), TRL **{S['total_wall_s']['trl']:.1f} s**: **{S['ratio_wall']:.3f}x** (goal <= 0.70x); "
         f"train loops alone {S['ratio_loop']:.3f}x; process CPU {S['ratio_cpu']:.3f}x",
         f"- fixed cost per run (process wall minus loop), mean: refcache {S['fixed_mean_s']['refcache']:.1f} s, "
         f"TRL {S['fixed_mean_s']['trl']:.1f} s", "",
         "Fixed cost by phase, wall seconds (CPU seconds in brackets); `other` is what no phase covers (the "
         "interpreter's exit, the command's output):", ""]
    return L + _phase_table(S["refcache"], "refcache") + [""] + _phase_table(S["trl"], "TRL")


def render_memory(M: dict) -> list[str]:
    size, runs = M["size"], M["runs"]
    L = [f"{size['model']} model ({M['params'] / 1e6:.1f}M params, {M['weights_mb']:.0f} MiB of fp32 weights), "
         f"batch {size['batch']} pairs, sequence {size['seq']}, {size['warmup'] + size['steps']} steps; peak RSS of "
         "each process.", "",
         "| configuration | peak RSS | / TRL live |", "|---|---|---|"]
    for key in ("cached", "cached_padded", "policy", "trl"):
        if key in runs:
            r = runs[key]
            name = r["mode"] if key.startswith("cached") else {"policy": "policy-only (padded)",
                                                               "trl": "TRL DPOTrainer, live reference"}[key]
            L.append(f"| {name} | {r['maxrss_mb']:,.0f} MiB | {r['maxrss_mb'] / runs['trl']['maxrss_mb']:.3f}x |")
    L += ["", f"Floor (TRL live minus the reference's weights): {M['floor_mb']:,.0f} MiB = {M['floor_vs_trl']:.3f}x "
          f"TRL. Cached (padded) is {M['above_floor']:+.3f} from the floor ({M['above_floor_mb']:+,.0f} MiB; target "
          f"<= +0.03) and {M['mem_cached_vs_policy']:.3f}x policy-only (target <= 1.02x).", "",
          "train-dpo's resident memory at the end of each phase (RSS / peak so far, MiB):", ""]
    order = ("startup", "imports", "checks", "verify", "load", "layout", "setup", "train", "save", "plot",
             "final_hash")
    for key in ("cached", "cached_padded"):
        if key in runs:
            ph = runs[key]["phases"]
            L.append(f"- {key}: " + ", ".join(f"{k} {ph[k]['rss_mb']}/{ph[k]['peak_rss_mb']}"
                                               for k in order if k in ph and "rss_mb" in ph[k]))
    return L


SECTIONS = [("sweep", "8. The whole job: a sweep of 3 runs (bench_sweep.py)", render_sweep),
            ("memory", "9. Peak memory at the limit a cache allows (bench_memory.py)", render_memory)]
