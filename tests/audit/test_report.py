"""audit/report.py and audit/checks.py without a cache: token statistics against a hand count, the text table,
strict JSON for damaged values, and how a rule's findings become one PASS / FAIL / SKIP check."""

from __future__ import annotations

import json
import math

import polars as pl

from audit.checks import FAIL, PASS, SKIP, from_findings
from audit.report import _jsonable, table, token_stats
from schemas.findings import Finding


def test_token_stats_match_a_hand_count():
    index = pl.DataFrame({"prompt_tokens": [3, 5, 10, 2], "chosen_tokens": [1, 4, 4, 7],
                          "rejected_tokens": [2, 2, 9, 3]}).cast(pl.Int32)
    stats = {s["part"]: s for s in token_stats(index)}
    assert list(stats) == ["prompt", "chosen", "rejected", "completion"]
    assert (stats["prompt"]["total"], stats["prompt"]["mean"], stats["prompt"]["max"]) == (20, 5.0, 10)
    completions = sorted([1, 4, 4, 7, 2, 2, 9, 3])  # chosen and rejected together
    c = stats["completion"]
    assert (c["total"], c["mean"], c["max"]) == (sum(completions), round(sum(completions) / 8, 2), 9)
    assert c["p50"] in completions and c["p95"] == 9  # "nearest": a value that occurs


def test_table_aligns_numbers_right_and_text_left():
    lines = table(["check", "rows"], [["manifest", 1234], ["sums", 5]]).splitlines()
    assert lines == ["  check      rows", "  --------  -----", "  manifest  1,234", "  sums          5"]
    assert table(["a"], []).splitlines() == ["  a", "  -"]


def test_json_report_is_strict():
    value = {"nan": math.nan, 1: [math.inf, -math.inf, (1, 2.5)], "ok": None, "path": object}
    text = json.dumps(_jsonable(value), allow_nan=False)  # raises if a NaN or infinity got through
    back = json.loads(text)
    assert back["nan"] == "nan" and back["1"] == ["inf", "-inf", [1, 2.5]] and back["ok"] is None
    assert back["path"] == str(object)


def test_findings_become_one_check():
    found = [Finding("sums", "values", "chosen_logp is not the sum", expected=-1.5, found=-2.0, shard="s0", row=3,
                     count=2), Finding("sums", "values", "another", shard="s1", row=0)]
    check = from_findings("sums", found, checked=40, unit="row", what="sums agree")
    assert (check.status, check.shard, check.row) == (FAIL, "s0", 3)
    assert check.detail == "3 of 40 rows: chosen_logp is not the sum (expected -1.5, found -2.0)"
    passed = from_findings("sums", [], checked=1, unit="shard", what="sums agree", unchecked_shards=2)
    assert passed.status == PASS and passed.detail == "1 shard: sums agree; 2 shard(s) not checked (failed shard_files)"
    assert from_findings("sums", [], checked=0, unit="row", what="").status == SKIP
