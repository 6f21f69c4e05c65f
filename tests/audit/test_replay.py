"""audit/replay.py: audit-ref --model replays cached rows through the plain forward of the shipped data/ model: all 40
rows pass in float32 and a 1e-3 change in one token is found and located; the sample is seeded; the tolerance
(runtime/tolerance.py, tests/runtime/test_tolerance.py) follows the recorded dtype and device."""

from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl
import pytest

from conftest import DATA, audit_ref as audit, check_of as check, float32_sum
from conftest import precompute_in_process as precompute, rewrite_shard


# ---------------------------------------------------------------------------------------------------------------
# replay on the shipped data/ model


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("audit-data")
    lines = (DATA / "prefs" / "train.jsonl").read_text().splitlines(keepends=True)[:40]
    (base / "train.jsonl").write_text("".join(lines))
    return precompute(DATA / "sft-model", base / "train.jsonl", base / "cache", rows_per_shard=2048)


def test_replay_on_data_passes_in_float32_and_finds_a_1e_3_change(data_cache, tmp_path):
    cache = Path(shutil.copytree(data_cache, tmp_path / "cache"))
    code, report, output = audit(cache, "--model", DATA / "sft-model", "--all")
    assert code == 0, output
    info = check(report, "replay")["info"]
    assert (info["rows"], info["dtype"], info["tolerance"]) == (40, "float32", 1e-4)
    assert info["token_max_abs_diff"] <= 1e-5

    def edit(rows):
        values = rows[17]["chosen_logps"]
        values[2] -= 1e-3
        rows[17]["chosen_logp"] = float32_sum(values)

    rewrite_shard(cache, "shard-00000.parquet", edit)
    code, report, output = audit(cache, "--model", DATA / "sft-model", "--all")
    assert code == 1, output
    assert report["failed"] == ["replay"]
    replay = check(report, "replay")
    assert (replay["shard"], replay["row"]) == ("shard-00000.parquet", 17)
    assert "chosen token 2" in replay["detail"] and replay["info"]["tokens_beyond_tolerance"] == 1
    assert 0.9e-3 < replay["info"]["token_max_abs_diff"] < 1.1e-3


def test_replay_sample_is_seeded(data_cache):
    runs = [audit(data_cache, "--model", DATA / "sft-model", "--sample", 5, "--seed", s,
                  json_path=data_cache.parent / f"a{i}.json")[1] for i, s in enumerate((7, 7, 8))]
    infos = [check(r, "replay")["info"] for r in runs]
    assert infos[0]["rows"] == 5 and len(set(infos[0]["sampled"])) == 5
    assert infos[0]["sampled"] == infos[1]["sampled"] and infos[0]["sampled"] != infos[2]["sampled"]
    cached = {r["id"]: r for r in pl.read_parquet(sorted(data_cache.glob("*.parquet"))).to_dicts()}
    for info in infos:  # the rows named are the rows replayed: their completion tokens add up to the replayed count
        assert info["tokens"] == sum(len(cached[i]["chosen_input_ids"]) + len(cached[i]["rejected_input_ids"])
                                     for i in info["sampled"])
