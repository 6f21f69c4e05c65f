"""precompute-ref --update (precompute/update.py, schemas/history.py): a cache brought to data that grew, shrank or
changed scores only the new rows and equals a cache made from scratch; the versions it keeps; refusals; kill -9 and
rerun; audit-ref of a run trained on the earlier version; train-dpo on a subset of the cache's rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import transformers

from conftest import (HELPERS, REPO, audit_ref, paused_in_shard, check_of, count_models, dir_state, fake_run, manifest_of, pref_rows,
                      shard_hashes, write_jsonl)
from conftest import precompute_cli as cli, precompute_ok as ok, scored_now
import precompute.job as job_module
from schemas import format as fmt
from schemas.cache import open_cache

ROWS, PER_SHARD = 40, 8
PAUSE_HELPER = str(HELPERS / "precompute_pause.py")


@pytest.fixture(scope="module")
def rows():
    return pref_rows(ROWS + 4, seed=41)  # 40 rows, then 4 (10%) appended


@pytest.fixture()
def base(llama_dir, rows, tmp_path):
    """A finished cache of the first 40 rows (5 shards of 8)."""
    data = write_jsonl(tmp_path / "v1.jsonl", rows[:ROWS])
    out = tmp_path / "cache"
    ok("--model", llama_dir, "--data", data, "--out", out, "--rows-per-shard", PER_SHARD)
    return out


def update(llama_dir, data, out, *extra):
    return cli("--model", llama_dir, "--data", data, "--out", out, "--rows-per-shard", PER_SHARD, "--update", *extra)


class Forwards:
    """Every forward of the model (sequences through it) and every pair handed to the scorer, counted in process."""

    def __init__(self, monkeypatch):
        self.sequences, self.scored = 0, []
        forward, score = transformers.LlamaForCausalLM.forward, job_module.score_known

        def counting(model, *args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            embeds = kwargs.get("inputs_embeds")
            self.sequences += (ids if ids is not None else embeds).shape[0]
            return forward(model, *args, **kwargs)

        def scoring(model, pairs, *args, **kwargs):
            self.scored += list(pairs)
            return score(model, pairs, *args, **kwargs)

        monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", counting)
        monkeypatch.setattr(job_module, "score_known", scoring)


def by_id(out: Path) -> pl.DataFrame:
    """The cache's rows (its manifest's shards, read with refcache's reader after every check), sorted by id."""
    cache = open_cache(out)
    return pl.concat([pl.from_arrow(fmt.read_columns(p)) for p in cache.shard_paths]).sort("id")


def assert_same_rows(a: pl.DataFrame, b: pl.DataFrame):
    assert a["id"].to_list() == b["id"].to_list()
    for column in ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids", "mask_checksum"):
        assert a[column].to_list() == b[column].to_list(), column
    for column in ("chosen_logps", "rejected_logps"):  # batched with other rows: float32 rounding apart
        x, y = (np.concatenate(f[column].to_list()) for f in (a, b))
        assert np.allclose(x, y, rtol=0, atol=2e-6), (column, np.abs(x - y).max())
    for column in ("chosen_logp", "rejected_logp"):
        assert np.allclose(a[column].to_numpy(), b[column].to_numpy(), rtol=1e-6, atol=1e-5), column


# ---------------------------------------------------------------------------------------------------------------
# growing, shrinking, changing


def test_appending_10_percent_scores_only_the_new_rows_and_equals_a_cache_made_from_scratch(
        llama_dir, rows, base, tmp_path, monkeypatch):
    before = shard_hashes(base)
    v1 = manifest_of(base)
    grown = write_jsonl(tmp_path / "v2.jsonl", rows)
    # What scoring the 4 new rows alone costs, probe included: a fresh cache of them.
    new_only = write_jsonl(tmp_path / "new.jsonl", rows[ROWS:])
    counted = Forwards(monkeypatch)
    ok("--model", llama_dir, "--data", new_only, "--out", tmp_path / "new-only", "--rows-per-shard", PER_SHARD)
    fresh_sequences, fresh_scored = counted.sequences, counted.scored
    counted.sequences, counted.scored = 0, []
    result = update(llama_dir, grown, base)
    assert result.exit_code == 0, result.output
    assert scored_now(result) == (44, 4)
    new_ids = [r["id"] for r in rows[ROWS:]]
    assert counted.scored == fresh_scored and len(counted.scored) == 4  # the 4 new pairs, nothing else
    # The model ran over the new rows and the batching probe (of new rows too) only: as many sequences as a fresh
    # cache of the 4 new rows (15 here: the mode's batches and the probe's reference forwards), far fewer than the
    # 44 rows' 88 sequences.
    assert counted.sequences == fresh_sequences < 2 * 44, (counted.sequences, fresh_sequences)
    manifest = manifest_of(base)
    assert manifest["version"] == 2 and manifest["update"] == {"from_version": 1, "added": new_ids, "removed": [],
                                                               "replaced": []}
    assert [s["file"] for s in manifest["shards"]] == [s["file"] for s in v1["shards"]] + ["shard-v00002-00000.parquet"]
    assert {k: v for k, v in shard_hashes(base).items() if k in before} == before  # no shard rewritten
    assert json.loads((base / "manifest-00001.json").read_text()) == v1  # the previous version kept as it was
    assert manifest["history"][0]["version"] == 1 and manifest["history"][0]["file"] == "manifest-00001.json"

    scratch = tmp_path / "scratch"
    ok("--model", llama_dir, "--data", grown, "--out", scratch, "--rows-per-shard", PER_SHARD)
    assert_same_rows(by_id(base), by_id(scratch))
    assert manifest["rows"] == 44 and manifest["stamps"]["model_hash"] == manifest_of(scratch)["stamps"]["model_hash"]

    # The same update again: nothing to do, no file changes.
    state = dir_state(base)
    assert scored_now(update(llama_dir, grown, base)) == (44, 0)
    assert dir_state(base) == state


def test_removed_rows_are_listed_and_their_shards_copied_without_a_forward(llama_dir, rows, base, tmp_path):
    before = shard_hashes(base)
    gone = [rows[3]["id"], rows[5]["id"], rows[20]["id"]]  # two from shard 0, one from shard 2
    shrunk = write_jsonl(tmp_path / "v2.jsonl", [r for r in rows[:ROWS] if r["id"] not in gone])
    old = by_id(base)
    with count_models() as built:
        result = update(llama_dir, shrunk, base)
    assert result.exit_code == 0, result.output
    assert built == [] and scored_now(result) == (37, 0)  # no model loaded at all
    manifest = manifest_of(base)
    assert manifest["update"]["removed"] == gone and manifest["update"]["added"] == []
    files = [s["file"] for s in manifest["shards"]]
    assert files == ["shard-v00002-00000.parquet", "shard-00001.parquet", "shard-v00002-00001.parquet",
                     "shard-00003.parquet", "shard-00004.parquet"]
    assert shard_hashes(base) | before == shard_hashes(base)  # every earlier shard still there, unchanged
    now = by_id(base)
    kept = old.filter(~pl.col("id").is_in(gone))
    assert now.equals(kept)  # the copied rows are the cached values, bit for bit
    # Both versions read: the old manifest names the old shards, every one of them still there.
    v1 = json.loads((base / "manifest-00001.json").read_text())
    assert all((base / s["file"]).is_file() for s in v1["shards"])


def test_changed_content_is_refused_then_replaced_with_replace_changed(llama_dir, rows, base, tmp_path, monkeypatch):
    changed = [dict(r) for r in rows[:ROWS]]
    for i in (2, 9, 17):
        changed[i]["chosen"] = changed[i]["chosen"] + " and more"
    data = write_jsonl(tmp_path / "v2.jsonl", changed)
    state = dir_state(base)
    result = update(llama_dir, data, base)
    assert result.exit_code != 0
    ids = [rows[i]["id"] for i in (2, 9, 17)]
    assert "3 row(s) of --data changed content" in result.output and all(repr(i) in result.output for i in ids)
    assert "--replace-changed" in result.output
    assert dir_state(base) == state  # nothing written

    counted = Forwards(monkeypatch)
    result = update(llama_dir, data, base, "--replace-changed")
    assert result.exit_code == 0, result.output
    assert scored_now(result) == (40, 3) and len(counted.scored) == 3
    assert manifest_of(base)["update"]["replaced"] == ids
    scratch = tmp_path / "scratch"
    ok("--model", llama_dir, "--data", data, "--out", scratch, "--rows-per-shard", PER_SHARD)
    assert_same_rows(by_id(base), by_id(scratch))


@pytest.fixture(scope="module")
def llama_other(tmp_path_factory, tokenizer) -> Path:
    from conftest import build_llama, save_checkpoint

    return save_checkpoint(build_llama(len(tokenizer), seed=5), tokenizer, tmp_path_factory.mktemp("llama-other"))


@pytest.mark.parametrize("change", ["model", "max_length", "dtype"])
def test_another_model_encoding_or_computation_is_refused_naming_it(llama_dir, llama_other, rows, base, tmp_path,
                                                                    change):
    grown = write_jsonl(tmp_path / "v2.jsonl", rows)
    model, extra = (llama_other, []) if change == "model" else (llama_dir, {
        "max_length": ["--max-length", "64"], "dtype": ["--dtype", "bfloat16"]}[change])
    state = dir_state(base)
    result = update(model, grown, base, *extra)
    assert result.exit_code != 0
    named = {"model": "model_hash mismatch", "max_length": "this run gives --max-length 64",
             "dtype": "this run gives --dtype bfloat16"}[change]
    # a setting given that differs: the option and the cache's value to pass (the update takes it when left out)
    remedy = {"model": "another --out", "max_length": "pass --max-length 1024", "dtype": "pass --dtype float32"}[change]
    assert named in result.output and remedy in result.output, result.output
    assert dir_state(base) == state


def test_without_update_a_rerun_on_grown_data_is_refused_and_points_to_update(llama_dir, rows, base, tmp_path):
    state = dir_state(base)
    result = cli("--model", llama_dir, "--data", write_jsonl(tmp_path / "v2.jsonl", rows), "--out", base,
                 "--rows-per-shard", PER_SHARD)
    assert result.exit_code != 0 and "already holds a different cache" in result.output
    assert "--update" in result.output
    assert dir_state(base) == state


def test_update_without_a_cache_and_with_overwrite_is_refused(llama_dir, rows, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    result = update(llama_dir, data, tmp_path / "empty")
    assert result.exit_code != 0 and "does not exist" in result.output
    assert "to make a new cache there, leave out --update" in result.output  # the way on for a new cache
    result = update(llama_dir, data, tmp_path / "empty", "--overwrite")
    assert result.exit_code != 0 and "pass one of them" in result.output


# ---------------------------------------------------------------------------------------------------------------
# kill -9 during an update


def test_update_killed_mid_shard_then_rerun_gives_the_uninterrupted_result(llama_dir, rows, base, tmp_path):
    # 20 new rows (3 new shards), and 2 rows removed (1 shard copied)
    more = [{**r, "id": f"n{i:04d}"} for i, r in enumerate(pref_rows(20, seed=43))]
    grown = write_jsonl(tmp_path / "v2.jsonl", [r for r in rows[:ROWS] if r not in (rows[1], rows[2])] + more)
    clean = tmp_path / "clean"
    shutil.copytree(base, clean)
    assert update(llama_dir, grown, clean).exit_code == 0
    # write_table calls: the copied shard (0), then new shards 1, 2: pause in the second scored shard
    args = ["--model", str(llama_dir), "--data", str(grown), "--out", str(base), "--rows-per-shard", str(PER_SHARD),
            "--update", "--no-progress"]
    with paused_in_shard(args, 2, tmp_path / "paused", cwd=REPO):
        assert manifest_of(base).get("version") is None  # still version 1: the manifest is written last
    assert (base / "shard-v00002-00001.parquet").is_file() and not (base / "shard-v00002-00002.parquet").exists()
    assert open_cache(base).manifest.get("version") is None  # version 1 still reads, the update's shards aside
    result = update(llama_dir, grown, base)
    assert result.exit_code == 0, result.output
    assert scored_now(result) == (58, 12), result.output  # shard 1 (8 rows) kept from before the kill: 8 + 4 left to score
    assert shard_hashes(base) == shard_hashes(clean)
    a, b = manifest_of(base), manifest_of(clean)
    for key in ("shards", "stamps", "rows", "version", "update", "history"):
        assert a[key] == b[key], key
    assert sorted(p.name for p in base.iterdir()) == sorted(p.name for p in clean.iterdir())  # no temp files
    open_cache(base)


# ---------------------------------------------------------------------------------------------------------------
# audit-ref of the versions, and train-dpo on a round's own rows


def test_audit_of_a_run_on_the_earlier_version_passes_against_that_version(llama_dir, rows, base, tmp_path):
    run = fake_run(tmp_path / "run", llama_dir, base)  # trained on version 1
    grown = write_jsonl(tmp_path / "v2.jsonl", rows[4:])  # 4 rows removed, 4 added
    assert update(llama_dir, grown, base).exit_code == 0
    code, report, output = audit_ref(base, "--run", run)
    assert code == 0, output
    assert report["version"] | {"version": 1, "file": "manifest-00001.json", "current": 2} == report["version"]
    assert "version 1 of the cache (manifest-00001.json)" in check_of(report, "run_cache")["detail"]
    assert report["stats"]["rows"] == ROWS  # the version's own rows
    assert "audited as version 1" in output
    # the current version audits too, and a run of it says it is the current one
    code, report, output = audit_ref(base)
    assert code == 0, output
    run2 = fake_run(tmp_path / "run2", llama_dir, base)
    code, report, _ = audit_ref(base, "--run", run2)
    assert code == 0 and report["version"]["file"] == "manifest.json"

    # --data: the grown data matches, with the update's lists; the earlier data is named as version 1's
    v1_data = write_jsonl(tmp_path / "v1-again.jsonl", rows[:ROWS])
    code, report, _ = audit_ref(base, "--model", llama_dir, "--data", grown)
    data = check_of(report, "data_rows")
    assert code == 0 and "4 rows added, 4 removed" in data["detail"]
    assert data["info"]["update"]["removed"] == [r["id"] for r in rows[:4]]
    code, report, _ = audit_ref(base, "--model", llama_dir, "--data", v1_data)
    assert code == 1 and "this is the data of version 1" in check_of(report, "data_rows")["detail"]
    # a run's data against the version it trained on passes
    code, report, _ = audit_ref(base, "--model", llama_dir, "--data", v1_data, "--run", run)
    assert check_of(report, "data_rows")["status"] == "PASS" and check_of(report, "run_cache")["status"] == "PASS"


def test_train_dpo_on_a_subset_of_the_cache_rows(llama_dir, rows, base, tmp_path):
    from dpo.config import TrainConfig
    from dpo.recipe import run_train
    from runtime.errors import JobError
    from schemas.findings import CacheError

    subset = write_jsonl(tmp_path / "round.jsonl", rows[10:22])  # one round's own rows
    summary = run_train(TrainConfig(model=str(llama_dir), data=str(subset), output_dir=str(tmp_path / "run"),
                                    ref_cache=str(base), use_cpu=True, max_steps=2, per_device_train_batch_size=4,
                                    plot=False), log=lambda m: None)
    assert summary is not None and (tmp_path / "run" / "run-manifest.json").is_file()
    # a row the cache does not hold is still refused, by id
    outside = write_jsonl(tmp_path / "outside.jsonl", rows[10:12] + rows[ROWS:ROWS + 1])
    with pytest.raises((CacheError, JobError)) as e:
        run_train(TrainConfig(model=str(llama_dir), data=str(outside), output_dir=str(tmp_path / "run-2"),
                              ref_cache=str(base), use_cpu=True, max_steps=1, plot=False), log=lambda m: None)
    assert "1 of 3 data rows are not in" in str(e.value) and rows[ROWS]["id"] in str(e.value)


def test_two_updates_keep_both_earlier_versions_and_overwrite_clears_them(llama_dir, rows, base, tmp_path):
    run = fake_run(tmp_path / "run", llama_dir, base)  # trained on version 1
    v2 = write_jsonl(tmp_path / "v2.jsonl", rows[2:42])
    v3 = write_jsonl(tmp_path / "v3.jsonl", rows[5:44])
    assert update(llama_dir, v2, base).exit_code == 0
    assert update(llama_dir, v3, base).exit_code == 0
    manifest = manifest_of(base)
    assert manifest["version"] == 3 and [h["file"] for h in manifest["history"]] == ["manifest-00001.json",
                                                                                      "manifest-00002.json"]
    assert manifest["update"] == {"from_version": 2, "added": [rows[42]["id"], rows[43]["id"]],
                                  "removed": [r["id"] for r in rows[2:5]], "replaced": []}
    # every earlier version in the history says when it was made and what its update did (UX pass: only the current
    # one did), as its own manifest records it
    v2_manifest = json.loads((base / "manifest-00002.json").read_text())
    first, second = manifest["history"]
    assert "added" not in first and first["created_at"] == json.loads((base / "manifest-00001.json").read_text())[
        "created_at"]
    assert second["created_at"] == v2_manifest["created_at"]
    assert {k: second[k] for k in ("added", "removed", "replaced")} == {
        k: len(v2_manifest["update"][k]) for k in ("added", "removed", "replaced")}
    assert second["removed"] == 2  # rows 0 and 1, as v2.jsonl left them out
    assert by_id(base)["id"].to_list() == [r["id"] for r in rows[5:44]]
    for old in ("manifest-00001.json", "manifest-00002.json"):  # every file a version names is still there
        assert all((base / s["file"]).is_file() for s in json.loads((base / old).read_text())["shards"])
    code, report, output = audit_ref(base, "--run", run)
    assert code == 0, output
    assert report["version"] | {"version": 1, "file": "manifest-00001.json", "current": 3} == report["version"]
    # a version file whose bytes are not the recorded ones is not taken for that version
    (base / "manifest-00001.json").write_text((base / "manifest-00001.json").read_text().replace('"rows"', '"rows" '))
    code, report, _ = audit_ref(base, "--run", run)
    assert code == 1 and check_of(report, "run_cache")["status"] == "FAIL"
    # --overwrite starts over: the versions go with the rest
    ok("--model", llama_dir, "--data", v3, "--out", base, "--rows-per-shard", PER_SHARD, "--overwrite")
    assert not list(base.glob("manifest-*.json")) and "version" not in manifest_of(base)
    assert cli("--model", llama_dir, "--data", v3, "--out", base, "--replace-changed").exit_code != 0


def test_a_top_k_cache_updates_to_the_cache_made_from_scratch(llama_dir, rows, tmp_path):
    top = ["--rows-per-shard", PER_SHARD, "--top-k", 4]
    out = tmp_path / "cache"
    ok("--model", llama_dir, "--data", write_jsonl(tmp_path / "v1.jsonl", rows[:ROWS]), "--out", out, *top)
    grown = write_jsonl(tmp_path / "v2.jsonl", rows[1:])  # one row removed (shard 0 copied), 4 added
    result = cli("--model", llama_dir, "--data", grown, "--out", out, "--update", *top)
    assert result.exit_code == 0, result.output
    assert scored_now(result) == (43, 4)
    scratch = tmp_path / "scratch"
    ok("--model", llama_dir, "--data", grown, "--out", scratch, *top)
    a, b = by_id(out), by_id(scratch)
    assert_same_rows(a, b)
    for column in ("chosen_top_ids", "rejected_top_ids"):
        assert a[column].to_list() == b[column].to_list(), column
    for column in ("chosen_top_logps", "rejected_top_logps", "chosen_tail", "rejected_tail"):
        x, y = (np.concatenate([np.asarray(v, np.float64).ravel() for v in f[column].to_list()]) for f in (a, b))
        assert np.allclose(x, y, rtol=0, atol=2.5e-4), column  # the stored 16-bit codes' step apart at most


def test_an_update_killed_after_keeping_the_old_manifest_finishes_and_a_foreign_version_file_is_refused(
        llama_dir, rows, base, tmp_path):
    shrunk = write_jsonl(tmp_path / "v2.jsonl", rows[1:ROWS])
    kept = (base / fmt.MANIFEST).read_bytes()
    (base / "manifest-00001.json").write_bytes(kept)  # where a kill just before manifest.json leaves it
    assert update(llama_dir, shrunk, base).exit_code == 0
    assert (base / "manifest-00001.json").read_bytes() == kept and manifest_of(base)["version"] == 2

    other = tmp_path / "other"
    ok("--model", llama_dir, "--data", write_jsonl(tmp_path / "o.jsonl", rows[:ROWS]), "--out", other,
       "--rows-per-shard", PER_SHARD)
    edited = json.loads((other / fmt.MANIFEST).read_text())
    edited["created_at"] = "1999-01-01T00:00:00+00:00"
    (other / "manifest-00001.json").write_text(json.dumps(edited))
    result = update(llama_dir, shrunk, other)
    assert result.exit_code != 0 and "is not the manifest it would keep" in result.output
    assert "version" not in manifest_of(other)
