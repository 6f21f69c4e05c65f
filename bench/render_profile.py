"""Sections of the page for the profiling parts: compile (phases, segments), vocab, topk, topk-train."""

from __future__ import annotations

import measure
from report import mb, ms, sec, table, x


def _cpu_share(v) -> str:
    return f"{v:.2f}" if v is not None else "-"


PHASE_NOTES = {
    "probe: reference forwards": "overhead: runtime.logprobs.reference_logps, the whole forward over each probe "
                                 "sequence (every position's logits), the truth the mode is checked against",
    "probe: mode forwards": "overhead: the mode's own scoring of the probe pairs, one batch",
    "model forwards": "the decoder's forward (scored work)",
    "head (projection + log-softmax)": "output projection and log-softmax of the scored positions, in chunks",
    "score_pairs": "batching, padding, splitting the values (Python, per batch)",
    "model hash (background thread)": "overlaps the phases above (not in the total)",
}


def _render_phases(c: dict) -> list[str]:
    """run_precompute's phase table (bench_flops.phase_profile)."""
    phases = c.get("precompute", {}).get("phases")
    if not phases:
        return []
    total = phases["total"]
    rows = []
    for path, v in sorted(((k, v) for k, v in phases.items() if k != "total"),
                          key=lambda kv: (bool(kv[1].get("background")), -kv[1]["wall"])):
        if v["wall"] < 0.0005 and not v.get("background"):
            continue
        leaf = path.split(" / ")[-1]
        note = PHASE_NOTES.get(leaf, "")
        if path.startswith(("mode choice /", "head check /")) and not leaf.startswith("probe"):
            note = "overhead: " + ("the batching-mode probe's" if path.startswith("mode") else "the head check's (24 "
                                   "tokens)") + f" {leaf}"
        share = "" if v.get("background") else f" ({v['wall'] / total['wall']:.0%})"
        cpu_share = "" if v.get("background") else f" ({v['cpu'] / total['cpu']:.0%})"
        rows.append([path, f"{v['wall']:.3f} s{share}", f"{v['cpu']:.3f} s{cpu_share}", note])
    rows.append(["**total**", f"{total['wall']:.3f} s", f"{total['cpu']:.3f} s", ""])
    p = c["precompute"]
    score = p["times"]["score"]["median"]
    probe = sum(v["cpu"] for k, v in phases.items() if k.startswith("mode choice"))
    scoring = sum(v["cpu"] for k, v in phases.items() if k.startswith("score_pairs"))
    L = ["", f"Where precompute-ref's time goes, {c['case']} ({p['pairs']} pairs, mode {p['mode']}, "
         f"{p.get('threads', '?')} torch thread(s)): one run_precompute after the timed ones, each phase's own "
         "seconds (a nested phase's time is its own: `A / B` is B called inside A). score_pairs alone, timed "
         f"above, took {score:.3f} s (median); a plain padded HF forward of the same pairs "
         f"{p['times']['padded_hf']['median']:.3f} s.", ""] + table("phase | wall | CPU | what", rows)
    body = p.get("body_matmuls")
    if body:
        L += ["", f"The body's own matmuls at their own shapes ({body['tokens']} rows x " + ", ".join(
              f"{k} ({v['layers']} layers, {v['share_of_mm']:.2f})" for k, v in body["shapes"].items()) +
              f", CPU seconds) run at **{body['share_of_mm']:.2f}** of the 2048^3 matmul's rate: the ceiling of this "
              "model's forward on this machine if attention and the elementwise work (norms, rotary embeddings, "
              "SiLU, residual adds) were free."]
    if scoring:
        L += ["", f"The batching-mode probe (its reference forwards and the mode's own forwards of the probe pairs) "
              f"took {probe:.2f} CPU s, {probe / total['cpu']:.0%} of the run and {probe / scoring:.2f}x the scoring "
              f"of the job's {p['pairs']} pairs ({scoring:.2f} CPU s): a cost per job, about "
              f"{probe / scoring * p['pairs']:.1f} pairs' worth of scoring at these lengths, whatever the number of "
              "pairs; the end-to-end share above is the scoring's diluted by it and the other fixed costs."]
    return L


SEGMENTS = {"start>step_begin": "batch fetch and collation, the Trainer's loop",
            "step_begin>pre_optimizer_step": "forward + backward (loss, gather) + gradient clipping",
            "pre_optimizer_step>optimizer_step": "optimizer step (AdamW)",
            "optimizer_step>end": "scheduler, zeroing the gradients"}


def _render_segments(c: dict) -> list[str]:
    t = c.get("train")
    if not t or not t.get("segments"):
        return []
    seg = t["segments"]
    total_w, total_c = sum(v["wall"] for v in seg.values()), sum(v["cpu"] for v in seg.values())
    rows = [[SEGMENTS.get(k, k), f"{v['wall'] * 1e3:,.0f} ms ({v['wall'] / total_w:.0%})",
             f"{v['cpu'] * 1e3:,.0f} ms ({v['cpu'] / total_c:.0%})"] for k, v in seg.items()]
    return ["", f"Where a train-dpo step's time goes, {c['case']} (cached reference, prefix_shared, batch "
            f"{c['size']['batch']} pairs, {t.get('threads', '?')} torch thread(s)), median per timed step, split at "
            "the Trainer's callbacks:", ""] + table("part of the step | wall | CPU", rows)


def render_compile(C: dict) -> list[str]:
    L = ["torch.compile (inductor, dynamic shapes) of precompute-ref's scoring forward (`--torch-compile`) and of the "
         "train-dpo step (TrainingArguments' `--torch-compile`), against the same work eager, with part 11's useful "
         "FLOPs and matmul rate (shares per process, median over rounds). Compile time is apart: the first compiled "
         "call (score_pairs) and the warm-up steps (training: a static graph, then a dynamic one at the first new "
         "shape) are not in the timed figures; precompute-ref end to end is shown whole, compile and probe included.",
         ""]
    rows = []
    for c in C["cases"]:
        p = c.get("precompute")
        if p:
            for k, name in (("score", "score_pairs, eager"), ("score_compiled", "score_pairs, compiled")):
                rows.append([c["case"], f"{name} ({p['mode']}, {p['pairs']} pairs)", sec(p["times"][k]),
                             f"**{p['share_of_mm'][k]:.2f}**"])
        e2e = c.get("end_to_end")
        if e2e:
            names = {"eager": "eager", "compiled_cold": "--torch-compile, cold inductor cache",
                     "compiled_warm": "--torch-compile, warm inductor cache"}
            for r in e2e["runs"]:
                rows.append([c["case"], f"precompute-ref CLI end to end, {names[r['name']]} ({e2e['pairs']} pairs; "
                             f"CPU {r['cpu_s']:.0f} s)", f"{r['wall_s']:.1f} s", f"**{r['share_of_mm']:.2f}** "
                             f"(CPU seconds {r['share_of_mm_cpu']:.2f})"])
        for k, name, layout in (("train", "train-dpo step, eager", "prefix_shared"),
                                ("train_compiled", "train-dpo step, --torch-compile", "prefix_shared"),
                                ("train_padded", "train-dpo step, eager", "padded"),
                                ("train_padded_compiled", "train-dpo step, --torch-compile", "padded")):
            if k in c:
                rows.append([c["case"], f"{name} ({layout}, batch {c['size']['batch']} pairs)", sec(c[k]["step"]),
                             f"**{c[k]['share_of_mm']:.2f}**"])
    L += table("case | work | time | useful share of matmul", rows)
    for c in C["cases"]:
        p = c.get("precompute")
        if p:
            wall = p["refcache_wall_s"][0]
            L += ["", f"- {c['case']}: compiled score_pairs is **{p['compiled_over_eager']:.2f}x** the eager rate; its "
                  f"first call (the compile, inductor's cache warm) took {p['compiled_first_call_s'][0]:.0f} s. "
                  f"precompute-ref end to end: {wall['eager']:.0f} s eager, {wall['torch_compile']:.0f} s with "
                  f"--torch-compile (compiled: {p['refcache_compiled']}; {' '.join(p['log'])})."]
        for eager, compiled, ratio, layout in (("train", "train_compiled", "train_step_eager_over_compiled",
                                                 "prefix_shared"),
                                                ("train_padded", "train_padded_compiled",
                                                 "train_padded_step_eager_over_compiled", "padded")):
            if compiled in c and eager in c:
                warm = c[compiled]["warmup_step_s"][0]
                L += ["", f"- {c['case']}, {layout}: the compiled train-dpo step is **{c[ratio]:.2f}x** the eager "
                      f"step's speed; its warm-up steps took {', '.join(f'{v:.0f}' for v in warm)} s (eager: "
                      f"{', '.join(f'{v:.1f}' for v in c[eager]['warmup_step_s'][0])} s)."]
        prof = c.get("train_compiled", {}).get("profile")
        optimizer = _total_share(prof, "Optimizer.step#") if prof else None
        if optimizer is not None:
            L += ["", f"- What --torch-compile leaves eager: the optimizer step (AdamW's elementwise mul_/lerp_/sqrt/"
                  f"addcdiv_ per parameter) is {optimizer:.0%} of the compiled step's time in its profile; the "
                  "Trainer compiles the model, not the optimizer (`--optim adamw_torch_fused` is the Trainer's fused "
                  "kernel for it)."]
        if prof:
            L += ["", f"<details><summary>torch.profiler, the last timed compiled train-dpo step on {c['case']} (top "
                  "ops by self time)</summary>", "", "```", prof.rstrip(), "```", "</details>"]
    loads = "; ".join(f"{c['case']}: " + ", ".join(f"{k} {' '.join(map(str, v))}" for k, v in c.get("loadavg", {}).items())
                      for c in C["cases"])
    return L + ["", f"1-minute load average (2 cores) at the start of the part {C.get('loadavg_start')}, at the end of "
                f"each child: {loads}."] + C.get("notes", [])


def _total_share(profile: str, op: str) -> float | None:
    """The CPU-total share (children included) of the first row of a torch.profiler table whose name starts with
    `op`."""
    for line in profile.splitlines():
        cells = line.split()
        if len(cells) >= 7 and cells[0].startswith(op) and cells[3].endswith("%"):
            return float(cells[3].rstrip("%")) / 100
    return None


def _prefix_share(profile: str, prefix: str) -> float:
    """The self-CPU share of every row of a torch.profiler table whose name starts with `prefix`."""
    return sum(float(cells[-6].rstrip("%")) / 100 for cells in (line.split() for line in profile.splitlines())
               if len(cells) >= 7 and cells[0].startswith(prefix) and cells[-6].endswith("%"))


def _self_share(profile: str, op: str) -> float | None:
    """The self-CPU share of `op` in a torch.profiler table."""
    for line in profile.splitlines():
        cells = line.split()
        if cells and cells[0] == op:
            return float(cells[1].rstrip("%")) / 100
    return None


def render_vocab(V: dict) -> list[str]:
    s, R = V["size"], V["runs"]
    names = {"precompute": "precompute-ref (chunked head)", "precompute_keep": "precompute-ref, head logits_to_keep",
             "ours": "train-dpo, cached (chunked head)", "ours_keep": "train-dpo, cached, head logits_to_keep",
             "trl_precompute": "TRL DPOTrainer, precompute_ref_log_probs=True",
             "trl_live": "TRL DPOTrainer, live reference"}
    trl = R.get("trl_precompute", {}).get("maxrss_mb")
    rows = []
    for mode, r in R.items():
        if "error" in r:
            rows.append([names.get(mode, mode), r["error"], "", "", ""])
            continue
        t = sec(r["wall"], 1) + " (whole job)" if "wall" in r else ms(r["step"]) + " per step"
        loads = ", ".join(f"{x['loadavg']:.1f}" for x in r["rounds"])
        rows.append([names.get(mode, mode), mb(r["maxrss_mb"]), x(r["maxrss_mb"] / trl, 3) if trl else "-", t,
                     mb(r["baseline_rss_mb"]), loads])
    L = [f"Llama-style, hidden {V['spec']['hidden']} x {V['spec']['layers']} layers, vocabulary {V['spec']['vocab']:,} "
         f"({V['params'] / 1e6:.1f}M parameters, {V['weights_mb']:.0f} MiB of float32 weights, nearly all of them "
         f"the two embeddings); {s['pairs']} synthetic pairs of 1,024-2,048 tokens per sequence ({V['tokens']:,} "
         f"tokens), max length {s['seq']}; training batch {s['batch']} pair(s), {s['warmup']} warm-up + {s['steps']} "
         "timed steps; each configuration a process of its own, peak RSS of the whole process (TRL's includes its "
         "reference pass in __init__, ours is train-dpo alone: the cache was written by another process).", ""]
    L += table("configuration | peak RSS | / TRL precompute_ref_log_probs | time | baseline after imports | load "
               "average (1 min, at the end)", rows)
    L.append("")
    if "precompute" in R:
        p = R["precompute"]
        L.append(f"- precompute-ref peak {mb(p['maxrss_mb'])} = weights {V['weights_mb']:.0f} MiB + "
                 f"{(p['maxrss_mb'] - V['weights_mb']) / 1024:.2f} GiB (target <= 1 GiB above the weights), of which "
                 f"{mb(p['baseline_rss_mb'])} is the process after its imports (torch, transformers, datasets, "
                 f"pyarrow) before any work. The rest is the batching-mode probe's reference forward "
                 "(runtime.logprobs.reference_logps, the truth every mode is checked against) over the job's longest "
                 "pair: the model's own logits over that whole sequence (the definition runs the head on every "
                 "position, as model(ids).logits does), about 0.5 MiB per token at this vocabulary, plus one 128 MiB "
                 "chunk of its log-softmax.")
    if "ours" in R and trl:
        L.append(f"- train-dpo peak {mb(R['ours']['maxrss_mb'])} = **{R['ours']['maxrss_mb'] / trl:.3f}x** TRL with "
                 f"precompute_ref_log_probs ({mb(trl)}; target <= 0.5x)")
    if "ours" in R and "ours_keep" in R:
        extra = R["ours_keep"]["maxrss_mb"] - R["ours"]["maxrss_mb"]
        per = V.get("scored_per_step_max")
        L.append(f"- the model's own head for the scored positions (`logits_to_keep`, the path of models whose logits "
                 f"the chunked projection does not reproduce) costs {mb(extra)} more at the peak than the chunked "
                 "head" + (f": the step's forward holds up to {per:,} scored positions x {V['spec']['vocab']:,} "
                           f"float32 logits ({per * V['spec']['vocab'] * 4 / 2**20:,.0f} MiB) and, in the backward, "
                           "their gradient" if per else "") + ". It grows with the scored tokens per step: lower "
                 "--per-device-train-batch-size (and raise --gradient-accumulation-steps) to bound it (README).")
    return L + V.get("notes", [])


def render_topk(K: dict) -> list[str]:
    L = table("case | K | bytes per completion token | top-k columns, bytes per token",
              [[case, k, f"{r['bytes_per_completion_token']:.1f}",
                ", ".join(f"{c} {v:.2f}" for c, v in r["per_column_per_token"].items()) or "-"]
               for case, rows in K.items() if isinstance(rows, dict) and "0" in rows for k, r in rows.items()])
    t = K["time"]
    L += ["", "Precompute time on data/ (full_forward), K = 32 and K = 0 round-robin:", "",
          *table("what | K = 0 | K = 32 | K=32 / K=0",
                 [["whole precompute-ref run (load, probe, score, write)", sec(t["run_s"]["0"]), sec(t["run_s"]["32"]),
                   x(t["run_ratio_k32_over_k0"], 3)],
                  ["scoring and shard writing on the loaded model", sec(t["score_and_write_s"]["0"]),
                   sec(t["score_and_write_s"]["32"]), x(t["score_ratio_k32_over_k0"], 3)]]
                 + ([["whole run, CPU seconds on one torch thread", sec(t["run_cpu_s_one_thread"]["0"]),
                      sec(t["run_cpu_s_one_thread"]["32"]), x(t["run_cpu_ratio_k32_over_k0"], 3)]]
                    if "run_cpu_s_one_thread" in t else []))]
    return L


def render_topk_train(T: dict) -> list[str]:
    s, base = T["size"], T["runs"]["sigmoid"]
    L = [f"{s['model']} model ({T['params'] / 1e6:.1f}M parameters), sequences up to {s['seq']} tokens, batch "
         f"{s['batch']} pairs, {T['pairs']} pairs; top-k cache K = {T['top_k']}; {s['rounds']} rounds x "
         f"({s['warmup']} warm-up + {s['steps']} timed steps) per configuration, each round a fresh process.", ""]
    L += table("configuration | step time | vs sigmoid | peak RSS (process, to last step) | steady per-step peak RSS",
               [[mode, ms(r["step"]), x(measure.ratio(r["step"], base["step"]), 3),
                 f"{mb(r['maxrss_mb'])} ({x(r['maxrss_mb'] / base['maxrss_mb'], 3)})", mb(r["step_peak"]["median"])]
                for mode, r in T["runs"].items()])
    L += ["", "Where the time went before (profiles below, commit 07b0f2e): the policy's scores at the reference's ids "
          "took a masked copy of each chunk's logits, isneginf / all / where passes over it, a second log-sum-exp, and "
          "in the backward their gradients (each a tensor of the logits' size) summed by autograd. Now "
          "(runtime/distribution.py `_Distribution`) the log-probs, the scores at the ids and the tail come from one "
          "exp(logits - max) with the ids zeroed, and the backward is the closed form in one such tensor; with ids the "
          "head's elementwise work is below the plain log-softmax's, and what is left of a top-k step's extra is "
          "collating the [tokens, K] columns and the [tokens, K + 1] KL arithmetic in the loss."]
    for title, parts in (("this run", T.get("components")), ("before", T.get("components_before"))):
        if parts:
            note = f" ({parts['note']})" if "note" in parts else ""
            L += ["", f"CPU seconds per step on one torch thread, {title}{note}: median of {parts['reps']} steps per "
                  "configuration, interleaved in one process (collate, forward and loss, backward; no optimizer step):",
                  "", *table("configuration | collate | forward + loss | backward | total | vs sigmoid",
                             [[m, *(f"{t[k] * 1000:.1f} ms" for k in ("collate", "forward_loss", "backward", "total")),
                               x(t["vs_sigmoid"], 3)] for m, t in parts["cpu_s"].items()])]
    for title, profiles in (("before", T.get("profiles_before")), ("after", T.get("profiles_after")),
                            ("this run", T.get("profiles"))):
        for mode, prof in ((profiles or {}).get("tables") or profiles or {}).items():
            if isinstance(prof, str):
                note = f" ({profiles['note']})" if "note" in profiles else ""
                L += ["", f"<details><summary>torch.profiler, {mode}, {title}{note}: 2 steps after a warm-up (top ops "
                      "by self time)</summary>", "", "```", prof.rstrip(), "```", "</details>"]
    return L

