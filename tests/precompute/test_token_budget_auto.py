"""precompute-ref --token-budget auto on CPU: the default budget kept (or lowered where memory is short), the request
and the number it came to recorded, and a resume on another memory figure not refused."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from conftest import pref_rows, shard_hashes, write_jsonl
from precompute.cli import main
from runtime import budget
from schemas import format as fmt
from schemas.cache import open_cache


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def logps(out) -> dict:
    table = open_cache(out).scan(["id", "chosen_logps", "rejected_logps"]).to_pydict()
    return {i: (c, r) for i, c, r in zip(table["id"], table["chosen_logps"], table["rejected_logps"])}


def test_auto_on_cpu_keeps_the_default_and_records_it(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(12, seed=61))
    args = ["--model", llama_dir, "--data", data, "--rows-per-shard", "4", "--no-progress"]
    auto = invoke(*args, "--out", tmp_path / "auto", "--token-budget", "auto")
    assert auto.exit_code == 0, auto.output
    assert "token budget: auto -> 16384 (cpu: the default 16384" in auto.output
    comp = json.loads((tmp_path / "auto" / fmt.MANIFEST).read_text())["computation"]
    assert comp["token_budget"] == "auto"
    assert comp["token_budget_resolved"]["tokens"] == 16384 and "cpu" in comp["token_budget_resolved"]["why"]
    footer = json.loads(fmt.read_shard_metadata(tmp_path / "auto" / "shard-00000.parquet")["computation"])
    assert footer["token_budget"] == "auto" and "token_budget_resolved" not in footer  # a note: manifest only
    fixed = invoke(*args, "--out", tmp_path / "fixed", "--token-budget", "16384")
    assert fixed.exit_code == 0, fixed.output
    assert logps(tmp_path / "auto") == logps(tmp_path / "fixed")  # the same batches, the same numbers
    # a fixed number on a cache made with auto is another request: refused before loading, naming both
    again = invoke(*args, "--out", tmp_path / "auto", "--token-budget", "16384")
    assert again.exit_code == 2 and "the cache: --token-budget auto" in again.output and "this run:  --token-budget 16384" in again.output


def test_a_resume_where_auto_comes_to_another_number_is_not_refused(llama_dir, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(12, seed=67))
    out = tmp_path / "cache"
    args = ["--model", llama_dir, "--data", data, "--out", out, "--rows-per-shard", "4", "--no-progress",
            "--token-budget", "auto"]
    monkeypatch.setattr(budget, "free_memory", lambda model, device_type: 400 * 2**20)  # 400 MiB available
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    lowered = json.loads((out / fmt.MANIFEST).read_text())["computation"]["token_budget_resolved"]
    assert lowered["tokens"] < 16384 and "lowered" in lowered["why"], lowered
    clean, hashes = logps(out), shard_hashes(out)
    (out / fmt.MANIFEST).unlink()  # as if interrupted before the last shard
    (out / "shard-00002.parquet").unlink()
    monkeypatch.undo()  # this machine's own memory now: auto comes to the default
    rerun = invoke(*args)
    assert rerun.exit_code == 0, rerun.output
    assert "(2 already done)" in rerun.output and "token budget: auto -> 16384" in rerun.output
    assert json.loads((out / fmt.MANIFEST).read_text())["computation"]["token_budget_resolved"]["tokens"] == 16384
    assert shard_hashes(out)["shard-00000.parquet"] == hashes["shard-00000.parquet"]
    again = logps(out)
    assert again.keys() == clean.keys()
    for key, (c, r) in clean.items():
        np.testing.assert_allclose(again[key][0], c, atol=1e-5)
        np.testing.assert_allclose(again[key][1], r, atol=1e-5)


def test_a_bad_token_budget_is_a_usage_error():
    got = invoke("--model", "m", "--data", "d", "--token-budget", "lots")
    assert got.exit_code == 2 and "Invalid value for '--token-budget'" in got.output and "auto" in got.output
    help_text = invoke("--help").output
    assert "TOKENS|auto" in help_text and "on CPU auto keeps 16384" in " ".join(help_text.split())
