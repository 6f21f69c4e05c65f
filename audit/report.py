"""audit-ref's report: token statistics, the text rendering and strict JSON."""

from __future__ import annotations

from collections import Counter

import numpy as np
import polars as pl

from runtime.placement import describe
from schemas.findings import rebuild
from runtime.terminal import escaped
from storage.quoting import shell_word

from .checks import FAIL, PASS, SECTIONS, SKIP


def token_stats(index: pl.DataFrame) -> list[dict]:
    lengths = index.select("prompt_tokens", "chosen_tokens", "rejected_tokens").cast(pl.Int64)
    long = pl.concat([
        lengths.unpivot(variable_name="part", value_name="n"),
        lengths.select("chosen_tokens", "rejected_tokens").unpivot(value_name="n").select(
            pl.lit("completion_tokens").alias("part"), "n"),
    ])
    return long.group_by("part", maintain_order=True).agg(
        total=pl.col("n").sum(), mean=pl.col("n").mean().round(2),
        p50=pl.col("n").quantile(0.5, "nearest").cast(pl.Int64),
        p95=pl.col("n").quantile(0.95, "nearest").cast(pl.Int64), max=pl.col("n").max(),
    ).with_columns(pl.col("part").str.strip_suffix("_tokens")).to_dicts()


def _jsonable(v):
    """Strict JSON: NaN and infinities (a damaged cache's values) become strings."""
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not np.isfinite(v):
        return str(v)
    return v if v is None or isinstance(v, (str, int, float, bool)) else str(v)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return "" if v is None else escaped(v)  # a value from the cache or the data stays one line of its cell


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[_cell(v) for v in r] for r in rows]
    numeric = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    right = [bool(rows) and all(numeric(r[i]) for r in rows) for i in range(len(headers))]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values):
        return "  " + "  ".join(v.rjust(w) if a else v.ljust(w) for v, w, a in zip(values, widths, right)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _rows(stats: dict) -> str:
    """The cache's rows as its manifest lists them, and how many of them the audit could read where shards failed."""
    listed, read = stats.get("rows_listed", stats["rows"]), stats["rows"]
    return f"{listed:,} rows" + (f" ({read:,} of them in shards that passed shard_files)" if read != listed else "")


def render(report: dict) -> str:
    made = report["made"]
    sw = made.get("software") or {}
    comp = made.get("computation") or {}
    src = made.get("source") or {}
    out = [f"audit-ref {escaped(shell_word(report['cache']))}",
           f"  made {made.get('created_at')} by refcache {sw.get('refcache')} (" +
           ", ".join(f"{k} {v}" for k, v in sw.items() if k != "refcache") + ")",
           f"  reference {escaped((made.get('model') or {}).get('name'))} in {comp.get('dtype')} on "
           f"{comp.get('device_type')} ({comp.get('attn_implementation')} attention, {comp.get('mode')} batching); "
           f"data {escaped(shell_word(src.get('data')))} split {escaped(src.get('split'))}; "
           f"{_rows(report['stats'])}, {report['stats']['bytes'] / 2**20:.2f} MiB",
           *([f"  split by {describe(comp['layout'])}"] if isinstance(comp.get("layout"), dict) else []),
           *([f"  {v['line']}"] if (v := report.get("version")) else []),
           *([f"  audited as version {v['version']} of the cache ({v['file']}; current version {v['current']})"
              + (", the one the --run trained on" if report["options"].get("run") else "")]
             if v and v["file"] != "manifest.json" else []), ""]
    by_name = {c["name"]: c for c in report["checks"]}
    titles = {"cache": "Cache integrity", "model": "Reference model (--model)", "data": "Data (--data)",
              "run": "Training run (--run)"}
    for section, names in SECTIONS.items():
        rows = []
        for n in names:
            c = by_name[n]
            where = " ".join(x for x in (c["shard"], None if c["row"] is None else f"row {c['row']}") if x)
            rows.append([n, c["status"], where, c["detail"]])
        out += [titles[section], table(["check", "status", "where", "detail"], rows), ""]
    tok = report["stats"]["tokens"]
    out += ["Tokens", table(["tokens", "total", "mean", "p50", "p95", "max"],
                            [[t["part"], t["total"], t["mean"], t["p50"], t["p95"], t["max"]] for t in tok]), ""]
    lp = report["stats"]["logprobs_per_shard"]
    out += ["Log-probs per shard (per token; mean sequence sums; share of pairs the reference prefers chosen)",
            table(["shard", "rows", "tokens", "mean", "p5", "p50", "p95", "min", "max", "chosen_logp", "rejected_logp",
                   "chosen_higher"],
                  [[s["shard"], s["rows"], s["tokens"], s["mean"], s["p5"], s["p50"], s["p95"], s["min"], s["max"],
                    s["mean_chosen_logp"], s["mean_rejected_logp"], s["chosen_higher"]] for s in lp]), ""]
    if any(c["status"] == FAIL and c["name"] in SECTIONS["cache"] and c["name"] != "card" for c in report["checks"]):
        # a damaged cache (the card's check names its own remedy): the rebuild, naming what --overwrite would delete
        options, version = report.get("options") or {}, report.get("version") or {}
        earlier = [h for h in version.get("history") or [] if h.get("version") != version.get("current")]
        remedy = rebuild(report["cache"], {**made, "history": earlier}, model=options.get("model"),
                         data=options.get("data"))
        out.append(f"remedy: {remedy}")
    counts = Counter(c["status"] for c in report["checks"])
    verdict = f"FAIL: {', '.join(report['failed'])}" if report["failed"] else "PASS"
    out.append(f"{verdict} ({counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped) in "
               f"{report['timing']['total_s']:.2f} s")
    return "\n".join(out)
