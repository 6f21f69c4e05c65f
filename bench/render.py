"""bench/RESULTS.md from the JSON results under bench/results/ (no measurement of its own; run_all.py calls it).

Per device: the machine and load lines, the targets (ratios judged from the parts' results), the key figures, where
the time goes for a missed target, then one section per part whose results are there (SECTIONS: part, title,
renderer; each renderer turns a part's JSON into lines, mostly through `table`). A full run's results are used, else a
quick run's, marked as such in the section title.
"""

from __future__ import annotations

import json
from pathlib import Path

import common

ORDER = ("precompute", "train", "verify", "gather", "size", "scaling", "modes", "topk", "topk-train")  # machine and load lines: these parts


def load(results: Path, device: str) -> dict:
    out = {}
    for part in [*dict.fromkeys(p for p, _, _ in SECTIONS), "run"]:  # a full run's results, else a quick run's
        for path in (results / f"{part}-{device}.json", results / f"{part}-{device}-quick.json"):
            if path.exists():
                out[part] = json.loads(path.read_text())
                break
    return out


def table(head: str, rows) -> list[str]:
    """A Markdown table: `head` the header cells separated by ' | ', then one line per row of cells."""
    cells = head.split(" | ")
    return ["| " + head + " |", "|" + "---|" * len(cells)] + ["| " + " | ".join(map(str, r)) + " |" for r in rows]


def x(v, d=2) -> str:
    return "n/a" if v is None else f"{v:.{d}f}x"


def ms(st) -> str:
    return f"{st['median'] * 1000:,.0f} ms ({st['min'] * 1000:,.0f}-{st['max'] * 1000:,.0f})"


def sec(st, d=3) -> str:
    return f"{st['median']:.{d}f} s ({st['min']:.{d}f}-{st['max']:.{d}f})"


def mb(v) -> str:
    return f"{v:,.0f} MiB"


TARGETS = [  # (key, description, goal text, test)
    ("precompute_vs_bare", "precompute end to end vs bare batched forward (tokens/s)", ">= 0.9x", lambda v: v >= 0.9),
    ("precompute_vs_trl", "precompute vs TRL's reference precompute (tokens/s)", ">= 1.3x", lambda v: v >= 1.3),
    ("step_vs_policy", "cached training step vs policy-only (time)", "<= 1.05x", lambda v: v <= 1.05),
    ("step_vs_live", "cached training step vs live reference (time)", "<= 0.75x", lambda v: v <= 0.75),
    ("mem_vs_policy", "cached peak memory vs policy-only", "within 5%", lambda v: abs(v - 1) <= 0.05),
    ("hash_vs_sha256sum", "model hashing vs sha256sum (MB/s)", ">= 0.8x", lambda v: v >= 0.8),
    ("flops_precompute", "precompute-ref useful FLOP/s, share of the matmul rate (end to end)", ">= 0.70",
     lambda v: v >= 0.70),
    ("flops_score", "precompute-ref's scoring alone (score_pairs, no load/probe/write) useful FLOP/s, share of the "
     "matmul rate", ">= 0.70", lambda v: v >= 0.70),
    ("flops_train", "train-dpo step (cached, prefix_shared) useful FLOP/s, share of the matmul rate", ">= 0.60",
     lambda v: v >= 0.60),
    ("flops_train_compiled", "the same train-dpo step with --torch-compile (part 16), share of the matmul rate",
     ">= 0.60", lambda v: v >= 0.60),
    ("flops_precompute_job", "precompute-ref end to end on the same pairs in a job of 64 (part 11), share of the "
     "matmul rate", ">= 0.70", lambda v: v >= 0.70),
    ("flops_precompute_cpu", "the same end-to-end share in CPU seconds (each side's own process CPU time)",
     ">= 0.70", lambda v: v >= 0.70),
    ("flops_score_cpu", "the same scoring-alone share in CPU seconds", ">= 0.70", lambda v: v >= 0.70),
    ("flops_train_cpu", "the same train-dpo step share in CPU seconds", ">= 0.60", lambda v: v >= 0.60),
    ("vocab_train_mem", "128k vocabulary, seq 2048: train-dpo peak RSS vs TRL precompute_ref_log_probs", "<= 0.5x",
     lambda v: v <= 0.5),
    ("vocab_precompute_mem", "128k vocabulary, seq 2048: precompute-ref peak RSS above the weights (GiB)",
     "<= 1 GiB", lambda v: v <= 1.0),
    ("sweep_vs_trl", "the whole sweep (precompute + 3 train-dpo runs) vs TRL's fastest mode (wall)", "<= 0.45x",
     lambda v: v <= 0.45),
    ("topk_precompute", "precompute-ref --top-k 32 vs 0, whole run (time)", "<= 1.15x", lambda v: v <= 1.15),
    ("topk_step_kl", "training step with the top-k KL metrics (K=32) vs sigmoid on a plain cache (time)", "<= 1.10x",
     lambda v: v <= 1.10),
    ("topk_step_tdpo2", "training step, --loss-type tdpo2 (K=32) vs sigmoid on a plain cache (time)", "<= 1.10x",
     lambda v: v <= 1.10),
    ("topk_precompute_cpu", "the same precompute-ref ratio in CPU seconds on one torch thread", "<= 1.15x",
     lambda v: v <= 1.15),
    ("topk_step_kl_cpu", "the same KL-metrics step ratio in CPU seconds on one torch thread", "<= 1.10x",
     lambda v: v <= 1.10),
    ("topk_step_tdpo2_cpu", "the same tdpo2 step ratio in CPU seconds on one torch thread", "<= 1.10x",
     lambda v: v <= 1.10),
]


def _pair(a: dict, b: dict, where: str, higher_is_faster: bool = False) -> dict:
    """A target ratio from two stats dicts of times (a / b), or of speeds when higher_is_faster: the ratio of the
    medians, the ratio of the best repetitions (contention on a shared machine only ever adds time), and the spread
    (max / min) of the noisier of the two."""
    if higher_is_faster:
        best = a["max"] / b["max"]
    else:
        best = a["min"] / b["min"]
    spread = max(a["max"] / a["min"], b["max"] / b["min"])
    return {"value": a["median"] / b["median"], "best": best, "where": where, "spread": spread}


def measured(R: dict) -> dict:
    """The ratios the targets judge, from the part results."""
    m = {}
    if "precompute" in R:
        head = next((c for c in R["precompute"]["cases"] if c.get("headline")), R["precompute"]["cases"][-1])
        t = head["times"]
        m["precompute_vs_bare"] = _pair(t["bare"], t["refcache"], head["case"])
        if "trl" in t:
            m["precompute_vs_trl"] = _pair(t["trl"], t["refcache"], head["case"])
    if "train" in R:
        T = R["train"]
        where = f"{T['size']['model']}@{T['size']['seq']}"
        c, p, l = (T["runs"][k] for k in ("cached", "policy", "live"))
        m["step_vs_policy"] = _pair(c["step"], p["step"], where)
        m["step_vs_live"] = _pair(c["step"], l["step"], where)
        if T.get("cuda_mem_cached_vs_policy"):
            m["mem_vs_policy"] = {"value": T["cuda_mem_cached_vs_policy"], "best": None, "where": where + ", CUDA",
                                  "spread": 1.0}
        else:
            m["mem_vs_policy"] = {**_pair(c["maxrss"], p["maxrss"], where), "best": None}
    if "verify" in R:
        h = R["verify"]["hash"]
        mbps = h["mb_per_s"]
        m["hash_vs_sha256sum"] = _pair(mbps["model_hash"], mbps["sha256sum"], f"{h['mb']} MB file",
                                       higher_is_faster=True)
    if "flops" in R:
        long = next((c for c in R["flops"]["cases"] if c["size"]["model"] != "data"), None)
        threads = R["flops"].get("threads")
        where = f"{long['case']}, {threads} torch thread{'s' if threads != 1 else ''}" if long and threads else (
            long and long["case"])
        if long and "precompute" in long:
            p = long["precompute"]
            m["flops_precompute"] = _share(p["share_of_mm"]["refcache"], where)
            m["flops_score"] = _share(p["share_of_mm"]["score"], where)
            if "share_of_mm_cpu" in p:
                m["flops_precompute_cpu"] = _share(p["share_of_mm_cpu"]["refcache"], where)
                m["flops_score_cpu"] = _share(p["share_of_mm_cpu"]["score"], where)
        if long and "train" in long:
            m["flops_train"] = _share(long["train"]["share_of_mm"], where)
            if "share_of_mm_cpu" in long["train"]:
                m["flops_train_cpu"] = _share(long["train"]["share_of_mm_cpu"], where)
        job = next((c for c in R["flops"]["cases"] if c["size"].get("key") == "job" and "precompute" in c), None)
        if job:
            m["flops_precompute_job"] = _share(job["precompute"]["share_of_mm"]["refcache"], where)
    compiled = next(iter(R.get("compile", {}).get("cases", [])), {}).get("train_compiled")
    if compiled:
        m["flops_train_compiled"] = _share(compiled["share_of_mm"], R["compile"]["cases"][0]["case"])
    if "vocab" in R and "ours_vs_trl_precompute" in R["vocab"]:
        m["vocab_train_mem"] = _share(R["vocab"]["ours_vs_trl_precompute"], "128k vocab, seq 2048")
    if "sweep" in R:
        S = R["sweep"]
        m["sweep_vs_trl"] = _share(S["ratio_wall"], f"{S['size']['model']}, {S['size']['pairs']} pairs")
    if "vocab" in R and "precompute_over_weights_mb" in R["vocab"]:
        m["vocab_precompute_mem"] = _share(R["vocab"]["precompute_over_weights_mb"] / 1024, "128k vocab, seq 2048")
    if "topk" in R:
        t = R["topk"]["time"]["run_s"]
        m["topk_precompute"] = _pair(t["32"], t["0"], "data/")
        cpu = R["topk"]["time"].get("run_cpu_s_one_thread")
        if cpu:
            m["topk_precompute_cpu"] = _pair(cpu["32"], cpu["0"], "data/")
    if "topk-train" in R:
        T = R["topk-train"]
        where, runs = f"{T['size']['model']}@{T['size']['seq']}", T["runs"]
        for mode in ("kl", "tdpo2"):
            m[f"topk_step_{mode}"] = _pair(runs[mode]["step"], runs["sigmoid"]["step"], where)
            if T.get("components"):
                m[f"topk_step_{mode}_cpu"] = {"value": T["components"]["cpu_s"][mode]["vs_sigmoid"], "best": None,
                                              "where": where, "spread": 1.0}
    return m


def _share(value: float, where: str) -> dict:
    """A target value that is not a ratio of two timed medians (no best-repetition ratio)."""
    return {"value": value, "best": None, "where": where, "spread": 1.0}


def render_targets(R: dict) -> list[str]:
    m = measured(R)
    lines = ["| target | measured (ratio of medians) | goal | | ratio of best repetitions | spread (max/min) |",
             "|---|---|---|---|---|---|"]
    for key, desc, goal, ok in TARGETS:
        if key not in m:
            lines.append(f"| {desc} | not run | {goal} | - | | |")
            continue
        r = m[key]
        best = f"{r['best']:.3f}x ({'met' if ok(r['best']) else 'missed'})" if r["best"] is not None else "-"
        noisy = " (noisy)" if r["spread"] > 1.3 else ""
        unit = "" if key.startswith(("flops", "vocab_precompute")) else "x"
        lines.append(f"| {desc} | **{r['value']:.3f}{unit}** ({r['where']}) | {goal} | "
                     f"{'met' if ok(r['value']) else '**missed**'} | {best} | {r['spread']:.2f}{noisy} |")
    lines += ["", "The verdict is on the ratio of medians. The ratio of the best repetitions is shown beside it because "
              "other processes on a shared machine only ever add time; where the spread is large, read both."]
    return lines


def render_key_figures(R: dict) -> list[str]:
    L = []
    if "precompute" in R:
        P = R["precompute"]
        for c in P["cases"]:
            if c["case"] == "data/" or c.get("headline"):
                L.append(f"- precompute on {c['case']} ({c['pairs']} pairs, {c['params'] / 1e6:.1f}M params): "
                         f"**{c['tokens_per_s']['refcache']:,.0f} tokens/s** end to end (bare forward "
                         f"{c['tokens_per_s']['bare']:,.0f}), padding fraction {c['padding_fraction']:.1%} in "
                         f"plain length-sorted batches"
                         + (f" ({c['refcache_padding_fraction']:.1%} in the {c['mode']} rows refcache ran)"
                            if c.get("refcache_padding_fraction") is not None else "") + ", "
                         f"{c['bytes_per_completion_token']:.2f} cache bytes per completion token")
        for p in P.get("peak_memory", []):
            L.append(f"- precompute peak memory, {p['case']}: **{mb(p['peak_rss_mb'])} RSS** (process baseline after "
                     f"imports {mb(p['baseline_rss_mb'])}, weights {p['weights_mb']:.1f} MiB"
                     + (f", CUDA peak {mb(p['cuda_peak_mb'])}" if p.get("cuda_peak_mb") else "") + ")")
    if "size" in R:
        for c in R["size"]["cases"]:
            L.append(f"- cache size, {c['case']}: **{c['bytes_per_completion_token']:.2f} B per completion token**, "
                     f"{c['bytes_per_pair']:,.0f} B per pair (log-prob columns alone "
                     f"{c['logps_bytes_per_completion_token']:.2f} B/token)")
    if "train" in R:
        t = R["train"]
        s = t["size"]
        for mode in ("cached", "live", "policy", "trl"):
            if mode in t["runs"]:
                r = t["runs"][mode]
                cuda = f", CUDA peak {mb(r['cuda_peak_mb'])}" if r.get("cuda_peak_mb") else ""
                L.append(f"- train step, {mode}, {s['model']} ({t['params'] / 1e6:.1f}M) at seq {s['seq']}, batch "
                         f"{s['batch']} pairs: **{ms(r['step'])}**, peak RSS **{mb(r['maxrss_mb'])}**{cuda}")
    if "verify" in R:
        V = R["verify"]
        big = V["caches"][-1]
        L.append(f"- verification: **{big['s_per_gb']:.2f} s per GB**, **{big['s_per_million_rows']:.2f} s per million "
                 f"rows** (cache of {big['bytes'] / 1e9:.2f} GB, {big['rows']:,} rows); train-dpo's verify_and_join on "
                 f"data/ (400 pairs, encoding included): {sec(V['data_verify']['times'])}")
        if "train" in R and "verify_s" in R["train"]["runs"].get("cached", {}):
            L.append(f"- verification inside train-dpo, {R['train']['pairs']} pairs at seq {R['train']['size']['seq']}: "
                     f"{sec(R['train']['runs']['cached']['verify_s'])}")
    return L


def render_precompute(P: dict) -> list[str]:
    def tps(c, k):
        return f"{c['tokens_per_s'][k]:,.0f}" if k in c["tokens_per_s"] else "-"

    def time(c, k):
        return sec(c["times"][k]) if k in c["times"] else "-"

    L = table("case | params | pairs | tokens | padding | batching | refcache tok/s | score-only tok/s | score "
              "full_forward tok/s | bare tok/s | TRL tok/s | refcache/bare | score/bare | refcache/TRL",
              [[c["case"], f"{c['params'] / 1e6:.1f}M", c["pairs"], f"{c['tokens']:,}", f"{c['padding_fraction']:.1%}",
                c.get("mode", "full_forward"), *(tps(c, k) for k in ("refcache", "score_only", "score_full_forward",
                                                                      "bare", "trl")),
                x(c["ratio_refcache_vs_bare"]), x(c["ratio_score_vs_bare"]), x(c.get("ratio_refcache_vs_trl"))]
               for c in P["cases"]])
    L += ["", "Tokens/s counts the real tokens of the plain [prompt | completion] sequences for every column, so the "
          "columns compare times on identical work. Padding: of the bare forward's length-sorted batches. "
          "Batching: the mode run_precompute picked (auto).", "", "Wall time per pass, median (min-max):", ""]
    return L + table(
        "case | refcache | score-only | score full_forward | bare | TRL (load + DPOTrainer construction) | TRL "
        "precompute loop only",
        [[c["case"], *(time(c, k) for k in ("refcache", "score_only", "score_full_forward", "bare", "trl")),
          f"{c['trl_precompute_only_s']:.3f} s" if c.get("trl_precompute_only_s") else "-"] for c in P["cases"]])


def render_phases(P: dict) -> list[str]:
    phases = list(P["cases"][0]["phases_s"])
    share = lambda ph, p: "" if p == "total" else f" ({ph[p] / ph['total']:.0%})"
    return table("case | " + " | ".join(phases), [[c["case"], *(f"{c['phases_s'][p] * 1000:,.0f} ms"
                                                                + share(c["phases_s"], p) for p in phases)]
                                                  for c in P["cases"]])


def render_train(T: dict) -> list[str]:
    s, p = T["size"], T["runs"]["policy"]
    parts = lambda r: f"{mb(r['rss_parts_mb']['RssAnon'])} / {mb(r['rss_parts_mb']['RssFile'])}"
    L = [f"{s['model']} model ({T['params'] / 1e6:.1f}M parameters), sequences up to {s['seq']} tokens, batch "
         f"{s['batch']} pairs, {T['pairs']} pairs (padding {T['padding_fraction']:.1%}); {s['rounds']} rounds x "
         f"({s['warmup']} warm-up + {s['steps']} timed steps) per configuration, each round a fresh process.", ""]
    L += table("configuration | step time | vs policy-only | peak RSS (process, to last step) | steady per-step peak "
               "RSS | RSS at last step: anonymous / file-backed | baseline after imports | CUDA peak",
               [[mode, ms(r["step"]), x(common.ratio(r["step"], p["step"])),
                 f"{mb(r['maxrss_mb'])} ({x(r['maxrss_mb'] / p['maxrss_mb'], 3)})", mb(r["step_peak"]["median"]),
                 parts(r) if r.get("rss_parts_mb") else "-", mb(r["baseline_rss_mb"]),
                 mb(r["cuda_peak_mb"]) if r.get("cuda_peak_mb") else "-"] for mode, r in T["runs"].items()])
    L += ["", "Safetensors weights are loaded memory-mapped: a frozen model's weights stay file-backed pages (the live "
          "reference shows up in the file-backed column), the policy's become anonymous once the optimizer writes "
          "them. The file-backed column also holds the code pages of the libraries in use (cached mode touches more "
          "of polars and pyarrow, through verification). The anonymous heap varies by a few tens of MiB from process "
          "to process (allocator state), the scale of the cached-vs-policy difference.",
          "", f"cached/live step time {x(T['ratio_cached_vs_live'], 3)}; cached/TRL step time "
          f"{x(T.get('ratio_cached_vs_trl'), 3)}; peak memory cached/live {x(T['mem_cached_vs_live'], 3)}, "
          f"cached/TRL {x(T.get('mem_cached_vs_trl'), 3)}."]
    return L


def render_verify(V: dict) -> list[str]:
    steps = ("open_cache", "open_cache_fast", "check_rows", "check_values", "verify_all")
    L = table("cache | rows | open_cache (sha256) | open_cache (fast) | check_rows | check_values | verify (all) | "
              "s/GB | s/M rows", [[f"{c['bytes'] / 1e6:,.0f} MB", f"{c['rows']:,}",
                                   *(sec(c["times"][k]) for k in steps), f"{c['s_per_gb']:.2f}",
                                   f"{c['s_per_million_rows']:.2f}"] for c in V["caches"]])
    big, h = V["caches"][-1], V["hash"]
    L += ["", "Per GB, by step: " + ", ".join(f"{k} {v:.2f} s" for k, v in big["per_gb"].items()) + ".", "",
          f"Model hashing ({h['mb']} MB safetensors, page cache warm; bench/bench_hash.py, {h['runs']} runs of best-of-"
          f"{h['repeat']}, median (min-max) over runs):", ""]
    return L + table("tool | MB/s", [[tool, f"{st['median']:,.0f} ({st['min']:,.0f}-{st['max']:,.0f})"]
                                     for tool, st in h["mb_per_s"].items()])


def render_gather(G: dict) -> list[str]:
    by = {(r["vocab"], r["method"]): r for r in G["results"]}
    rows = []
    for v in sorted({r["vocab"] for r in G["results"]}):
        h, c, n = by[(v, "hidden")], by[(v, "chunked")], by[(v, "naive")]
        rows.append([f"{v:,}", f"{h['weights_mb']:.0f} MiB", f"{h['full_logits_mb']:,.0f} MiB",
                     f"{h['peak_mb']['median']:.0f} MiB", f"{c['peak_mb']['median']:.0f} MiB",
                     f"{n['peak_mb']['median']:,.0f} MiB", f"{n['peak_mb']['median'] / c['peak_mb']['median']:.1f}x",
                     sec(c["time"]), sec(n["time"])])
    s = G["summary"]
    return [f"Batch {G['batch']} x 1,024 tokens (completion: the second half), hidden 64, 2 layers. Peak memory above "
            "what was held before the call (weights, inputs), median (min-max):", ""] + table(
        "vocab | weights | full logits tensor | hidden (model activations) | chunked completion_logps | naive "
        "log_softmax | naive/chunked | time chunked | time naive", rows) + [
        "", f"Going from 32k to 128k vocabulary multiplies the chunked gather's peak by "
        f"{s['chunked_128k_vs_32k']:.2f}x and the naive one's by {s['naive_128k_vs_32k']:.2f}x: the chunked gather "
        "is bounded by its chunk (2^25 logits, 128 MiB in float32, plus the log-sum-exp temporary), whatever the "
        "vocabulary or sequence length."]


def render_size(S: dict) -> list[str]:
    def row(c):
        cols, tokens = c["columns"], c["completion_tokens"]
        ids = sum(v for k, v in cols.items() if k.endswith("input_ids"))
        per_row = sum(cols.get(k, 0) for k in ("id", "mask_checksum", "chosen_logp", "rejected_logp"))
        nd = c.get("bytes_per_completion_token_without_float_dictionary")
        return [c["case"], c["pairs"], f"{tokens:,}", f"{c['bytes']:,}", f"{c['bytes_per_completion_token']:.2f}",
                f"{c['bytes_per_pair']:,.0f}", f"{c['logps_bytes_per_completion_token']:.2f}", f"{ids / tokens:.2f}",
                f"{per_row / c['pairs']:.0f}",
                f"{nd:.2f} ({nd / c['bytes_per_completion_token'] - 1:+.0%})" if nd else "-"]

    return table("case | pairs | completion tokens | cache bytes | B/completion token | B/pair | log-prob columns, "
                 "B/completion token | id columns, B/completion token | per-row columns (id, checksum, sums), B/pair | "
                 "what-if: no dictionary on float columns, B/completion token", map(row, S["cases"])) + [
        "", "Raw float32 is 4 B per value; the log-prob columns of a random-init model's near-uniform predictions "
        "hardly compress, a trained model's (data/) do. Parquet's dictionary encoding, on by default, fails on "
        "such floats and its fallback costs more than plain encoding: the last column is what the same shards "
        "take with it off for the float columns."]


def render_scaling(S: dict) -> list[str]:
    return [f"{S['size']['model']} model, sequences up to {S['size']['seq']} tokens.", ""] + table(
        "scale | pairs | tokens | wall | tokens/s", [[p["scale"], p["pairs"], f"{p['tokens']:,}", sec(p["wall"]),
                                                     f"{p['tokens_per_s']:,.0f}"] for p in S["points"]]) + [
        "", f"Least-squares line: {S['fixed_s']:.2f} s fixed + {S['per_pair_s'] * 1000:.1f} ms per pair "
        f"(R^2 {S['r2']:.4f}); wall 2x/1x {S['wall_2x_over_1x']:.2f}, 4x/1x {S['wall_4x_over_1x']:.2f} "
        "(linear: 2.00 and 4.00, less the fixed share)."]


def render_modes(M: dict) -> list[str]:
    model = lambda c: f"{c.get('model', M['model'])} ({c.get('params', M['params']) / 1e6:.1f}M)"
    L = [f"Models of bench/common.py ({M['dtype']}, {M.get('attn_implementation', 'sdpa')} attention); "
         "precompute.modes.score_pairs in each mode on the same pairs and the same loaded model, round-robin "
         f"(`{M['command']}`, {M['machine']['date']}). Estimated: the "
         "full_forward/mode ratio of precompute.modes.estimated_cost, on which `--batching auto` decides.", ""]
    L += table("case | model | pairs | tokens | mode | time | tokens/s | vs full_forward | estimated | padding | max "
               "abs diff vs full_forward",
               [[c["name"], model(c), c["pairs"], f"{c['tokens']:,}", mode, sec(r["time"]), f"{r['tokens_per_s']:,.0f}",
                 x(r["speedup_vs_full_forward"]), x(r["estimated_speedup"]) if "estimated_speedup" in r else "-",
                 f"{r['padding_fraction']:.1%}", f"{r['max_abs_diff_vs_full_forward']:.1e}"]
                for c in M["cases"] for mode, r in c["modes"].items()])
    return L + [""] + [f"- {c['name']}: auto picks **{c['auto']}**; fastest measured {c['fastest']}; auto runs at "
                       f"{x(c['auto_vs_fastest'])} the fastest mode's speed." for c in M["cases"] if "auto" in c]


def render_analysis(R: dict) -> list[str]:
    """Where the time goes, for each missed target, from the measurements themselves."""
    m = measured(R)
    ok = {k: t(m[k]["value"]) for k, _, _, t in TARGETS if k in m}
    L = []
    if "precompute" in R and (not ok.get("precompute_vs_bare", True) or not ok.get("precompute_vs_trl", True)):
        P = R["precompute"]
        L.append("**Precompute vs bare forward.** Per case, the end-to-end pass splits into fixed costs and the "
                 "forward+gather; score-only isolates the gather's cost from the I/O:")
        for c in P["cases"]:
            ph = c["phases_s"]
            fixed = ph["total"] - ph["forward+gather"]
            probe = ph.get("mode probe", 0.0)
            L.append(f"- {c['case']}: total {ph['total']:.3f} s = forward+gather {ph['forward+gather']:.3f} s + "
                     f"batching-mode probe {probe:.3f} s ({probe / ph['total']:.0%}) + everything else "
                     f"{fixed - probe:.3f} s ({(fixed - probe) / ph['total']:.0%}; encode {ph['encode']:.3f} s, load "
                     f"model {ph['load model']:.3f} s, write+hash shards "
                     f"{ph['write shard'] + ph.get('hash shard', 0.0) + ph['build table']:.3f} s); bare forward "
                     f"{c['times']['bare']['median']:.3f} s, so forward+gather alone ({c.get('mode', 'full_forward')}) "
                     f"runs at {x(c['ratio_refcache_compute_vs_bare'])} the bare forward's speed")
        head = next((c for c in P["cases"] if c.get("headline")), None)
        if head and "trl" in head["times"] and not ok.get("precompute_vs_trl", True):
            ph, t = head["phases_s"], head["times"]
            probe = ph.get("mode probe", 0.0)
            L.append(f"- against TRL ({head['case']}): TRL's load + DPOTrainer construction takes "
                     f"{t['trl']['median']:.3f} s, {head.get('trl_precompute_only_s') or 0:.3f} s of it in its "
                     f"precompute loop; refcache's whole job {t['refcache']['median']:.3f} s, {probe:.3f} s of it in the "
                     f"mode probe. Without the probe the ratio would be "
                     f"{t['trl']['median'] / max(1e-9, t['refcache']['median'] - probe):.2f}x.")
        L += ["", "The probe (precompute.modes.choose_mode) scores a few pairs of the first shard twice, plain and "
                 "in the chosen mode, before the real work (the 2 shortest since commit 5e6e93d, the first 4 before): a fixed "
                 "cost, visible against a bench of a dozen pairs and negligible against a real data set.", ""]
        if head and head.get("profile"):
            L += [f"<details><summary>torch.profiler, one run_precompute on {head['case']} (top ops by self "
                  "time)</summary>", "", "```", head["profile"].rstrip(), "```", "</details>"]
    if "sweep" in R and not ok.get("sweep_vs_trl", True):
        S = R["sweep"]
        ours, trl = S["refcache"], S["trl"]
        mean = lambda runs, k: sum(r["fixed"]["wall_s"].get(k, 0) for r in runs) / len(runs)
        L += ["", f"**The whole sweep (part 8).** {S['ratio_wall']:.3f}x TRL's wall: the train loops alone are "
                 f"{S['ratio_loop']:.3f}x (train-dpo's cached step, batch layout auto, against TRL's padded one, both without a "
                 f"reference forward), and each of the 3 train-dpo processes pays {S['fixed_mean_s']['refcache']:.1f} s "
                 f"of fixed cost, of which {mean(ours, 'start-up/imports'):.1f} s is the interpreter's start and the "
                 f"imports (torch, transformers, datasets: TRL's start-up is {mean(trl, 'start-up/imports'):.1f} s, the "
                 f"same libraries) and {mean(ours, 'plot'):.1f} s the plot; precompute-ref once is "
                 f"{S['precompute']['wall_s']:.1f} s against TRL's reference pass of about "
                 f"{mean(trl, 'data + TRL reference precompute'):.1f} s in every run. Reaching 0.45x would need the "
                 "loop itself faster than 0.45x TRL's, or the libraries' start-up cut, which is not ours."]
    if "train" in R and not ok.get("step_vs_live", True):
        T = R["train"]
        c, l, p = (T["runs"][k]["step"]["median"] for k in ("cached", "live", "policy"))
        L += ["", f"**Cached vs live step.** The live step costs {l * 1000:,.0f} ms against {c * 1000:,.0f} ms cached: "
                 f"the reference forward is {(l - c) * 1000:,.0f} ms, {(l - c) / l:.0%} of the live step. A no-grad "
                 "forward is about a third of a forward+backward, so with a reference as large as the policy the live "
                 "step is about 4/3 of the cached one and cached/live about 0.75 at best; the optimizer step, the "
                 "collation and the loss add the same time to both sides, pushing the ratio above 0.75. The target "
                 "sits at the arithmetic bound of this comparison (the profiles below: the live steps' extra time is "
                 "the reference's matrix multiplies and attention)."]
    if "train" in R and not ok.get("step_vs_policy", True):
        L += ["", "**Cached vs policy-only step.** The two differ only in collating the cached values and reading them "
                 "in the loss; see the profiles below."]
    if "train" in R and not ok.get("mem_vs_policy", True):
        L += ["", "**Cached vs policy-only memory.** Cached mode also holds the verified cache rows and polars' "
                 "allocator pool from the verification read; see the per-step steady peak in the table above."]
    if "verify" in R and not ok.get("hash_vs_sha256sum", True):
        L += ["", "**Model hashing.** See bench/bench_hash.py's output below."]
    L += _flops_analysis(R, ok)
    profiles = R.get("train", {}).get("profiles") or {}
    for mode, table in profiles.items():
        if table:
            L += ["", f"<details><summary>torch.profiler, {mode}, 2 steps after a warm-up (top ops by self time)"
                  "</summary>", "", "```", table.rstrip(), "```", "</details>"]
    return L


def _flops_analysis(R: dict, ok: dict) -> list[str]:
    """Why the useful-FLOP/s shares (part 11) miss, from its phase table, profiles and the body matmuls' own rate."""
    long = next((c for c in R.get("flops", {}).get("cases", []) if c["size"]["model"] != "data"), None)
    missed = [k for k in ("flops_precompute", "flops_score", "flops_train") if not ok.get(k, True)]
    if not long or not missed or "precompute" not in long or not long["precompute"].get("phases"):
        return []
    p, ph = long["precompute"], long["precompute"]["phases"]
    total = ph["total"]["cpu"]
    probe = sum(v["cpu"] for k, v in ph.items() if k.startswith("mode choice"))
    forwards = sum(v["cpu"] for k, v in ph.items() if k.startswith("score_pairs"))
    mm = _self_share(p["profile"], "aten::mm") if p.get("profile") else None
    attention = _prefix_share(p["profile"], "aten::_scaled_dot_product") if p.get("profile") else None
    body = (p.get("body_matmuls") or {}).get("share_of_mm")
    L = ["", f"**Useful FLOP/s ({long['case']}, part 11).** End to end, run_precompute's CPU time is the scoring "
         f"{forwards / total:.0%}, the batching-mode probe {probe / total:.0%} (reference forwards over the probe's "
         f"sequences, the truth, and the mode's own forwards of them: a cost per job, about "
         f"{probe / forwards * p['pairs']:.1f} pairs' worth here) and the rest {1 - (forwards + probe) / total:.0%} "
         "(load, encode, head check, shard table, Parquet write and hash, manifest): on a job of "
         f"{p['pairs']} pairs the end-to-end share is about {forwards / total:.2f}x the scoring's; on thousands of "
         "pairs it is the scoring's."]
    job = next((c for c in R["flops"]["cases"] if c["size"].get("key") == "job" and "precompute" in c), None)
    if job:
        j = job["precompute"]
        L[-1] += (f" Measured on the same pairs in a job of {j['pairs']} ({job['case']}): end to end "
                  f"{j['share_of_mm']['refcache']:.2f} (CPU seconds {_cpu_share(j.get('share_of_mm_cpu', {}).get('refcache'))}), "
                  f"the scoring alone {j['share_of_mm']['score']:.2f}.")
    if mm is not None and attention is not None:
        L += ["", f"The scoring itself (score_pairs: the model's own forward, then the chunked head) is "
                 f"{mm:.0%} matrix multiplies, {attention:.0%} torch's CPU attention kernels and the rest elementwise "
                 "work (norms, rotary embeddings, SiLU, residual adds, the head's log-softmax) in its profile"
                 + (f"; the body's matmuls at their own shapes run at {body:.2f} of the 2048^3 rate" if body else "")
                 + ". What is ours in it (batching, padding, splitting the values, the head) is a few percent (the "
                 "phase table); the rest is the Hugging Face forward's own, which only fusing (torch.compile: part "
                 f"16{_compile_gain(R)}) or faster attention kernels would move."]
    t = long.get("train", {}).get("segments")
    if t:
        tot = sum(v["cpu"] for v in t.values())
        opt = t.get("pre_optimizer_step>optimizer_step", {}).get("cpu", 0.0)
        L += ["", f"The train-dpo step: forward + backward {t['step_begin>pre_optimizer_step']['cpu'] / tot:.0%} of "
                 f"its CPU time, the optimizer step {opt / tot:.0%} (AdamW; train-dpo's default is the Trainer's own, "
                 "`adamw_torch_fused` on this torch, since this issue), collation and the Trainer's loop under 1%."]
        compiled = next(iter(R.get("compile", {}).get("cases", [])), {}).get("train_compiled")
        if compiled:
            L[-1] += (f" With `--torch-compile` (part 16), which fuses the elementwise work of the forward and "
                      f"backward, the same step runs at {compiled['share_of_mm']:.2f} of the matmul rate.")
    return L


def _compile_gain(R: dict) -> str:
    """Part 16's compiled/eager scoring rate and its end-to-end cost, as a clause, if part 16 has run."""
    c = next(iter(R.get("compile", {}).get("cases", [])), {})
    p, e2e = c.get("precompute"), c.get("end_to_end")
    if not p:
        return ""
    clause = f", {p['compiled_over_eager']:.2f}x on the scoring"
    if e2e:
        wall = {r["name"]: r["wall_s"] for r in e2e["runs"]}
        clause += (f"; a job of {e2e['pairs']} pairs took {wall.get('eager', 0):.0f} s eager against "
                   f"{wall.get('compiled_cold', 0):.0f} s compiled with a cold inductor cache and "
                   f"{wall.get('compiled_warm', 0):.0f} s warm")
    return clause


def render_sweep(S: dict) -> list[str]:
    size, pre = S["size"], S["precompute"]

    def phases(runs: list[dict], label: str) -> list[str]:
        names = list(runs[0]["fixed"]["wall_s"])
        cell = lambda f, n: f"{f['wall_s'][n]:.2f}" + (f" ({f['cpu_s'].get(n, 0):.2f})" if n in f["cpu_s"] else "")
        return table(f"{label} run | process wall | loop | fixed | " + " | ".join(names),
                     [[i + 1, f"{r['wall_s']:.1f} s", f"{r['loop_s']:.1f} s", f"{r['fixed']['fixed_s']:.1f} s",
                       *(cell(r["fixed"], n) for n in names)] for i, r in enumerate(runs)])

    L = [f"{size['model']} model ({size['params'] / 1e6:.1f}M params), {size['pairs']} pairs, batch {size['batch']}, "
         f"max length {size['seq']}, betas {', '.join(map(str, size['betas']))} x {size['steps']} steps; every run a "
         "process of its own, started as a user starts it, interleaved (ours, then TRL, per beta). TRL: "
         "DPOTrainer with precompute_ref_log_probs=True and no ref_model (its faster mode; the reference log-probs "
         "are recomputed in every run).", "",
         f"- total wall: refcache **{S['total_wall_s']['refcache']:.1f} s** (precompute {pre['wall_s']:.1f} s + 3 "
         f"train-dpo), TRL **{S['total_wall_s']['trl']:.1f} s**: **{S['ratio_wall']:.3f}x** (goal <= 0.45x, issue 26; <= 0.70x before); "
         f"train loops alone {S['ratio_loop']:.3f}x; process CPU {S['ratio_cpu']:.3f}x",
         f"- fixed cost per run (process wall minus loop), mean: refcache {S['fixed_mean_s']['refcache']:.1f} s, "
         f"TRL {S['fixed_mean_s']['trl']:.1f} s", "",
         "Fixed cost by phase, wall seconds (CPU seconds in brackets); `other` is what no phase covers (the "
         "interpreter's exit, the command's output):", ""]
    return L + phases(S["refcache"], "refcache") + [""] + phases(S["trl"], "TRL")


def render_memory(M: dict) -> list[str]:
    size, runs = M["size"], M["runs"]
    names = {"policy": "policy-only (padded)", "trl": "TRL DPOTrainer, live reference"}
    L = [f"{size['model']} model ({M['params'] / 1e6:.1f}M params, {M['weights_mb']:.0f} MiB of fp32 weights), "
         f"batch {size['batch']} pairs, sequence {size['seq']}, {size['warmup'] + size['steps']} steps; peak RSS of "
         "each process.", ""]
    L += table("configuration | peak RSS | / TRL live",
               [[runs[k]["mode"] if k.startswith("cached") else names[k], f"{runs[k]['maxrss_mb']:,.0f} MiB",
                 f"{runs[k]['maxrss_mb'] / runs['trl']['maxrss_mb']:.3f}x"]
                for k in ("cached", "cached_padded", "policy", "trl") if k in runs])
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


def ran(R: dict) -> str:
    """How a part was run: its command and the 1-minute load average at its start and end."""
    return f"`{R['command']}`, 1-minute load average {R.get('loadavg_start')} -> {R['machine'].get('loadavg_1min')}"


def render_offload(O: dict) -> list[str]:
    size = O["size"]
    L = [f"{size['model']} model ({size['weights_bytes'] / 2**20:.1f} MiB of weights), {size['pairs']} pairs of up to "
         f"{size['seq']} tokens; run_precompute end to end, round-robin. offload: --device-map auto --max-memory half "
         "the weights (the rest read from disk at every forward); fits: --device-map auto with room for all "
         f"({ran(O)}: on a loaded machine only the ratio is worth reading).", ""]
    L += table("run | wall | tokens/s | vs in-memory | max abs diff vs in-memory | batching",
               [[n, sec(O["wall"][n]), f"{O['tokens'] / O['wall'][n]['median']:,.0f}", x(O["ratio_vs_in_memory"][n]),
                 f"{O['max_abs_diff_vs_in_memory'][n]:.1e}", O["mode"][n]] for n in O["wall"]])
    layout = O.get("layout") or {}
    return L + ["", f"Offload layout: {layout.get('modules')}; offload folder written to: "
                    f"{layout.get('offload_folder_used')}."]


def render_ranks(K: dict) -> list[str]:
    size = K["size"]
    L = [f"{size['model']} model; {size['shards']} shards of {size['rows_per_shard']} pairs, even shards up to "
         f"{size['long']} tokens, odd ones up to {size['short']} (data sorted by source); `torchrun --standalone "
         "--nproc-per-node 2` (gloo, one thread per rank) on the 2 cores, every way run in turn in each round; the summary's "
         f"per-rank scoring wall times ({ran(K)}: other processes share the cores, read the spreads side by side).", ""]
    L += table("shards dealt | tokens per rank | slowest rank's scoring | spread (max - min) | spread / slowest | job "
               "wall", [[w.replace("_", "-"), " / ".join(f"{t:,}" for t in r["rank_tokens"]), sec(r["slowest_rank_s"]),
                         sec(r["spread_s"]), f"{r['spread_share']:.0%}", sec(r["job_wall_s"])]
                        for w, r in K["ways"].items()])
    L += ["", f"Slowest rank, round-robin over by tokens: {x(K['slowest_rank_ratio'])}; every way wrote the same "
              "shards byte for byte. The job's wall time is mostly start-up (imports, model load, the probe) "
              "at these sizes; the scoring phase is what the dealing changes."]
    t = K.get("throughput")
    if not t:  # a result from before the 1-process comparison
        return L
    names = {"two_ranks": "2 ranks (torchrun, gloo; shards dealt by tokens)", "one_process_1_thread": "1 process",
             "one_process_all_cores": "1 process, all cores"}
    L += ["", f"The same job as 2 ranks and as 1 process, in the same rounds ({K['machine'].get('cores')} cores: 2 "
              "ranks of one thread use the whole machine as 1 process with a thread per core does, so ~1x is what to "
              "expect; the ranks pay off with one device per rank):", ""]
    L += table("run | processes x threads | tokens/s over the job's wall | tokens/s over the scoring | 2 ranks over it "
               "(job / scoring)",
               [[names.get(n, n), f"{r['processes']} x {r['threads']}", f"{r['job_tokens_per_s']['median']:,.0f}",
                 f"{r['scoring_tokens_per_s']['median']:,.0f}",
                 f"{x(t['job_ratio'][n])} / {x(t['scoring_ratio'][n])}" if n in t["job_ratio"] else ""]
                for n, r in t["runs"].items()])
    return L + ["", "Over the scoring: tokens over the slowest rank's scoring wall (one process: its own); over the "
                    "job's wall: start-up, planning, model load and the probe included. With other processes on the "
                    "cores (see the load average), one process of 2 torch threads is slowed far more than in "
                    "proportion whenever one of its threads is descheduled; processes of one thread each are not."]


def render_update(U: dict) -> list[str]:
    size = U["size"]
    L = [f"{size['model']} model; a cache of {size['pairs']} pairs of up to {size['seq']} tokens "
         f"({size['rows_per_shard']} per shard) and {size['added']} rows appended (10%); run_precompute end to end, "
         "the three ways round-robin after a warm-up (the cache copied back before each update, untimed). `new rows "
         "only`: a fresh cache of the appended rows alone, without a cache to verify and keep (its batching is its own "
         "choice on those rows; the update scores with the cache's mode) "
         f"({ran(U)}: other processes share the cores, read the ratios).", ""]
    L += table("run | wall | rows scored / rows in the cache | vs full precompute | batching",
               [[n, sec(U["wall"][n]), f"{U['rows_scored'][n]} / {U['rows'][n]}", x(U["ratio_vs_full"][n], 3),
                 U["mode"][n]] for n in U["wall"]])
    ok = U["ratio_vs_full"]["update"] <= U.get("target", 0.2)
    return L + ["", f"Target: update <= {U.get('target', 0.2)}x the full precompute: "
                    f"**{x(U['ratio_vs_full']['update'], 3)}** ({'met' if ok else 'missed'}). The updated cache and the "
                    f"full one agree value by value (max abs difference per token {U['max_abs_diff_vs_full']:.1e}, "
                    "rows matched by id). What an update costs beyond the new rows' forwards: the batching probe (on "
                    "new rows), the model load and hash, encoding the whole data set to find the new rows, and "
                    "the sha256 of the kept shards."]


def render_store(S: dict) -> list[str]:
    size = S["size"]
    L = [f"{size['model']} model, {size['pairs']} pairs of up to {size['seq']} tokens in {S['shards']} shards "
         f"({S['cache_bytes'] / 2**20:.2f} MiB); the same cache on local disk and on s3:// (a moto S3 server on "
         "127.0.0.1 in the bench's own process, sharing its cores: no network, the storage layer's own cost), "
         f"round-robin ({ran(S)}).", ""]
    what = {"precompute": "run_precompute --out", "verify": "open_cache (sha256 of every shard, footers, index)",
            "train": f"run_train --ref-cache, {size['steps']} steps"}
    L += table("step | local disk | s3:// | s3 / local",
               [[what[w], sec(S["wall"][f"{w}-local"]), sec(S["wall"][f"{w}-s3"]), x(S["ratio_s3_vs_local"][w])]
                for w in what])
    return L + ["", f"Values equal between the two caches: {S['same_values']}."]


def gf(v: float) -> str:
    return f"{v / 1e9:,.1f}"


def render_flops(F: dict) -> list[str]:
    L = ["Useful FLOPs are counted from the encoded pairs, the same numerator for every contender of a case (each "
         "prompt once, each completion once, no padding): forward = 2 x N_body per token (N_body: every weight matrix "
         "but the input and output embeddings; norm vectors do no matmul) + 2 x hidden x vocab per scored position (the head's matmul where its "
         "output is used: one position per completion token) + attention, 4 x heads x head_dim per (query, key) "
         "per layer, causal within each sequence (completion token j sees prompt + j keys); a training step is 3 x "
         "the forward of its batch (backward = 2 x forward; the optimizer not counted). The last column counts the "
         "head at every token instead (the Kaplan 2N convention with N including the head). The matmul rate: "
         "torch.mm of two 2048 x 2048 float32 matrices in the same child process, interleaved with the work "
         "(round-robin with the precompute contenders; once after every training step, outside its time). Shares "
         "are per process (its work against its own matmul rate), median over rounds.", ""]
    rows = []
    for c in F["cases"]:
        if "precompute" in c:
            p = c["precompute"]
            names = {"refcache": "precompute-ref end to end (run_precompute)",
                     "score": f"score_pairs alone ({p['mode']})",
                     "padded_hf": f"plain padded HF forward (padding {p['padded_hf_padding_fraction']:.0%})"}
            for k, name in names.items():
                rows.append([c["case"], name, f"{gf(p['flops']['total'])} ({p['pairs']} pairs)", sec(p["times"][k]),
                             gf(p["useful_flops_per_s"][k]), gf(p["mm_flops_per_s"]), f"**{p['share_of_mm'][k]:.2f}**",
                             _cpu_share(p.get("share_of_mm_cpu", {}).get(k)),
                             f"{p['share_of_mm_head_every_token'][k]:.2f}"])
        for layout, name in (("train", "train-dpo step, prefix_shared"), ("train_padded", "train-dpo step, padded")):
            if layout in c:
                t = c[layout]
                rows.append([c["case"], f"{name} (batch {c['size']['batch']} pairs)",
                             f"{gf(t['step_flops']['median'])} per step", ms(t["step"]), gf(t["useful_flops_per_s"]),
                             gf(t["mm_flops_per_s"]), f"**{t['share_of_mm']:.2f}**", _cpu_share(t.get("share_of_mm_cpu")),
                             f"{t['share_of_mm_head_every_token']:.2f}"])
    threads = F.get("threads")
    if threads:
        L += [f"Torch threads in every child: {threads}" + (" (the matmul on one thread too: the share is against "
              "one core's matmul rate)." if threads == 1 else ".") + " The share in CPU seconds divides each side's "
              "FLOPs by its own process CPU seconds (all threads), which other processes on the machine inflate far "
              "less than wall time.", ""]
    L += table("case | work | useful GFLOPs | time | useful GFLOP/s | matmul GFLOP/s | share of matmul | share in CPU "
               "seconds | share, head at every token", rows)
    loads = "; ".join(f"{c['case']}: " + ", ".join(f"{k} {' '.join(map(str, v))}" for k, v in c.get("loadavg", {}).items())
                      for c in F["cases"])
    L += ["", f"1-minute load average (2 cores) at the start of the part {F.get('loadavg_start')}, at the end of "
          f"each child: {loads or 'not recorded'}. Under load both the work and the matmul slow down; the share is "
          "their ratio within one process, so it is the figure to read, the absolute GFLOP/s are not."]
    for c in F["cases"]:
        L += _render_phases(c) + _render_segments(c)
    for c in F["cases"]:
        shapes = c.get("precompute", {}).get("profile_shapes")
        if shapes:
            L += ["", f"<details><summary>torch.profiler, score_pairs on {c['case']}, top ops by self time and input "
                  "shapes (the scoring forwards by shape)</summary>", "", "```", shapes.rstrip(), "```", "</details>"]
        for part, what in (("precompute", "score_pairs"), ("train", "the last timed train-dpo step (prefix_shared)"),
                           ("train_padded", "the last timed train-dpo step (padded)")):
            prof = c.get(part, {}).get("profile")
            if prof:
                L += ["", f"<details><summary>torch.profiler, {what} on {c['case']} (top ops by self time)</summary>",
                      "", "```", prof.rstrip(), "```", "</details>"]
    for c in F["cases"]:
        for part in ("precompute", "train"):
            share, prof = c.get(part, {}).get("share_of_mm"), c.get(part, {}).get("profile")
            mm = _self_share(prof, "aten::mm") if prof else None
            if mm is None:
                continue
            share = share["score"] if isinstance(share, dict) else share
            flops = c.get("precompute", {}).get("flops")
            attention = (f"{flops['attention'] / flops['total']:.0%} of the useful FLOPs of these pairs" if flops
                         else "a small part of the useful FLOPs")
            L += ["", f"- {c['case']}, {'score_pairs' if part == 'precompute' else 'train-dpo step'}: useful share "
                  f"{share:.2f} of the matmul rate; in its profile the matrix multiplies (aten::mm) take {mm:.0%} of "
                  f"the time, so (nearly all useful FLOPs being matmuls) they run at about {share / mm:.2f}x the 2048^3 rate; "
                  f"torch's CPU attention kernels take {_prefix_share(prof, 'aten::_scaled_dot_product'):.0%} "
                  f"({attention}, at a far lower rate than the matmuls), and the rest "
                  "goes to memory-bound elementwise work that does no counted FLOP (RMSNorm's pow/mean/mul, rotary "
                  "embeddings' neg/cat/mul/add, SiLU x up-projection, the key/value cache's cat in kv_cache mode, "
                  "the head's log-softmax; in training also AdamW's elementwise update and zeroing the gradients). "
                  "Without fusing those (torch.compile, issue 26 item 2) the share cannot pass the matmul share of "
                  "the time."]
    if any(c["size"]["model"] == "data" for c in F["cases"]):
        L += ["", "- data/: a 0.9M-parameter model (hidden 128) and pairs of a few dozen tokens: matrices of 128 x 384 "
              "do too little work per call for any kernel to reach the 2048^3 rate, and per-call overhead (Python, "
              "dispatch, the Trainer's step) dominates; its share is reported for completeness, not as a target."]
    L += ["", "- precompute-ref end to end adds its fixed costs to the scoring (loading, hashing, the batching-mode "
          "probe: the reference forward over every probe sequence and the mode's own forward of the probe pairs, "
          "writing the shards): on a handful of pairs they weigh as much as the scoring (the phase tables above)."]
    checks = [c["precompute"]["matmul_check"] for c in F["cases"] if c.get("precompute", {}).get("matmul_check")]
    if checks:
        L += ["", "Check of the count: torch.utils.flop_counter.FlopCounterMode on a forward over one unpadded "
              "sequence counts " + ", ".join(f"{k['flop_counter_matmuls']:,}" for k in checks) + " matmul FLOPs; "
              "this count's body + head at every token gives " + ", ".join(f"{k['ours']:,.0f}" for k in checks) +
              " (attention is counted by formula: the counter does not count torch's CPU attention kernel)."]
    return L + [""] + F.get("notes", [])


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
               [[mode, ms(r["step"]), x(common.ratio(r["step"], base["step"]), 3),
                 f"{mb(r['maxrss_mb'])} ({x(r['maxrss_mb'] / base['maxrss_mb'], 3)})", mb(r["step_peak"]["median"])]
                for mode, r in T["runs"].items()])
    L += ["", "Where the time went before (profiles below, commit 07b0f2e): the policy's scores at the reference's ids "
          "took a masked copy of each chunk's logits, isneginf / all / where passes over it, a second log-sum-exp, and "
          "in the backward their gradients (each a tensor of the logits' size) summed by autograd. Now "
          "(runtime/logprobs.py `_Distribution`) the log-probs, the scores at the ids and the tail come from one "
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


def render_probe(P: dict) -> list[str]:
    cpu, wall = P["cpu_times"], P["times"]
    rows = [[name, f"{cpu[k]['median']:.3f} s ({cpu[k]['min']:.3f}-{cpu[k]['max']:.3f})", sec(wall[k]),
             f"{cpu[k]['median'] / cpu['score']['median']:.2f}x"]
            for k, name in (("before", f"probe before: {len(P['probe_before'])} pairs {P['probe_before']}, one batch"),
                            ("now", f"probe now: {len(P['probe_now'])} pairs {P['probe_now']}, the mode's "
                                    "probe_budget"),
                            ("score", f"score_pairs of the job's {P['pairs']} pairs ({P['mode']['now']})"))]
    return [f"{P['case']}, choose_mode(auto) (the probe: reference forwards of its pairs, then the cheapest mode's "
            "forwards of them) before and after issue 26, and the job's scoring, interleaved in one process on one "
            "torch thread (`python bench/bench_probe.py`; what `before` was: the script's docstring). Mode chosen: "
            f"{P['mode']}.", ""] + table("work | CPU seconds | wall | vs scoring the job", rows) + [
            "", f"The probe now costs **{P['now_over_before_cpu']:.2f}x** its CPU time before; it is a cost per job, "
            f"here {cpu['now']['median'] / cpu['score']['median'] * P['pairs']:.1f} pairs' worth of scoring (before "
            f"{cpu['before']['median'] / cpu['score']['median'] * P['pairs']:.1f}). 1-minute load average at the end: "
            f"{P.get('loadavg_end')}."]


SECTIONS = [  # (part, title, renderer), in the order of RESULTS.md; parts 8 on run only when asked
    ("precompute", "1. Precompute throughput", render_precompute),
    ("precompute", "1b. Precompute phases (run_precompute, median over the timed passes)", render_phases),
    ("train", "2. Training step and peak memory", render_train),
    ("verify", "3. Verification and model hashing", render_verify),
    ("gather", "4. Memory of the log-prob gather", render_gather),
    ("size", "5. Cache size", render_size),
    ("scaling", "6. Scaling with the number of pairs", render_scaling),
    ("modes", "7. Precompute batching modes", render_modes),
    ("sweep", "8. The whole job: a sweep of 3 runs (bench_sweep.py)", render_sweep),
    ("memory", "9. Peak memory at the limit a cache allows (bench_memory.py)", render_memory),
    ("offload", "10. A reference split to disk (bench_offload.py)", render_offload),
    ("flops", "11. Useful FLOP/s against the machine's matmul rate (bench_flops.py)", render_flops),
    ("vocab", "12. A 128k vocabulary at sequence 2048 (bench_vocab.py)", render_vocab),
    ("topk", "13. Top-k cache: size and precompute time (bench_topk.py)", render_topk),
    ("topk-train", "14. Training step with a top-k cache: KL metrics, TDPO (bench_topk_train.py)", render_topk_train),
    ("ranks", "15. 2 ranks: shards dealt by tokens vs round-robin on skewed lengths, and vs 1 process "
              "(bench_ranks.py)", render_ranks),
    ("compile", "16. torch.compile of the scoring forward and the training step (bench_compile.py)", render_compile),
    ("update", "17. precompute-ref --update adding 10% rows vs a full rerun (bench_update.py)", render_update),
    ("store", "18. A cache on an object store (local S3 server) vs local disk (bench_store.py)", render_store),
    ("probe", "19. The batching-mode probe's cost, before and after issue 26 (bench_probe.py)", render_probe),
]


HEADER = """# refcache benchmarks

Generated by `bench/run_all.py` from the JSON under `bench/results/`; do not edit by hand. Each part is one script
(`bench/bench_*.py`, runnable alone, `--quick` for small sizes); see their docstrings for what exactly is timed.
Every time is a median over several repetitions after a warm-up, with (min-max). Ratios are taken between
measurements made back to back in one run on the same machine, interleaved round-robin where they share a process.
Models are Llama-style, built locally at fixed seeds (~1M: hidden 128 x 4 layers, vocab 1k; ~5M: hidden 256 x 4,
vocab 4k; ~35M: hidden 512 x 8, vocab 8k; GPU only ~350M: hidden 1024 x 24, vocab 32k) with a synthetic word-level
tokenizer, so sequence lengths are exact; `data/` is the embedded trained SFT model and its 400 training pairs.
Synthetic sequences hold between half and all of the stated length (prompt and each completion a quarter to a half).
"""

SCALE_NOTE = """Full-mode sizes are scaled down to finish in about ten minutes on 2 idle CPU cores: the 35M model is
timed at sequence 512 only (12 pairs for precompute; batch 2 pairs for training), the 1M and 5M models at 128, 512
and 1024 with a dozen to a few hundred pairs, the verification cache at about 1 GB (per-GB figures scale
linearly: compare the two cache sizes). On a shared machine absolute times are noisy (other processes compete for the
2 cores, and two torch threads slow down far more than in proportion when one of them is descheduled); the ratios,
measured back to back and interleaved, are the figures to read, with the load averages below as the context.

Run: `.venv/bin/python bench/run_all.py [--quick]` (all parts, then this file), or one part alone, e.g.
`.venv/bin/python bench/bench_precompute.py [--quick]`, then `bench/run_all.py --render-only` to refresh this file.
TRL's side needs `pip install trl` (the `bench` extra); without it those columns are skipped.
"""


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
    L = [HEADER, SCALE_NOTE]
    for device, title in (("cpu", "CPU"), ("cuda", "GPU")):
        R = load(Path(results), device)
        L.append(f"## {title}\n")
        if not any(p in R for p in ORDER):
            L.append("No results for this device yet" + (": run `bench/run_all.py` on a CUDA machine (device auto, "
                     "bf16, adds a ~350M model); the GPU results land here." if device == "cuda" else ".") + "\n")
            continue
        L += render_device(R)
    L += render_gpu_check(Path(results))
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
