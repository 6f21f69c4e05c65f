"""Sections of the page for the measuring parts: precompute, train, verify, size, modes, sweep, memory, offload,
update, store, flops (one renderer per part: its JSON to Markdown lines)."""

from __future__ import annotations

import measure
from report import mb, ms, sec, table, x
from render_profile import _cpu_share, _prefix_share, _render_phases, _render_segments, _self_share


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
               [[mode, ms(r["step"]), x(measure.ratio(r["step"], p["step"])),
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
          f"Model hashing ({h['mb']} MB safetensors, page cache warm; bench_verify.py's hash child, {h['runs']} runs "
          f"of best-of-{h['repeat']}, median (min-max) over runs):", ""]
    return L + table("tool | MB/s", [[tool, f"{st['median']:,.0f} ({st['min']:,.0f}-{st['max']:,.0f})"]
                                     for tool, st in h["mb_per_s"].items()])


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
