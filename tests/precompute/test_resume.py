"""precompute-ref over an --out that already holds something (precompute/resume.py): determinism, resume after an
interruption, refusal of another job's cache until --overwrite, the writer lock. The kill -9 test is in
test_cli.py."""

from __future__ import annotations

import fcntl
import shutil
from pathlib import Path

import pytest

from conftest import build_llama, dir_state, manifest_of, pref_rows, save_checkpoint, shard_hashes, write_jsonl
from conftest import assert_not_valid, precompute_cli as cli, precompute_ok as ok, scored_now
from schemas import format as fmt
from schemas.cache import open_cache


@pytest.fixture(scope="session")
def llama_other_dir(tmp_path_factory, tokenizer) -> Path:
    """Same architecture and tokenizer as llama_dir, different weights: only the model hash differs."""
    return save_checkpoint(build_llama(len(tokenizer), seed=1), tokenizer, tmp_path_factory.mktemp("llama-other"))

# ---------------------------------------------------------------------------------------------------------------
# 1. determinism and resume (the kill -9 test is in test_cli.py)


def test_two_clean_runs_are_byte_identical_and_resume_rescores_only_missing_shards(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(30, seed=11))
    args = ["--model", llama_dir, "--data", data, "--rows-per-shard", 4]
    ok(*args, "--out", tmp_path / "a")
    ok(*args, "--out", tmp_path / "b")
    clean = shard_hashes(tmp_path / "a")
    assert len(clean) == 8 and shard_hashes(tmp_path / "b") == clean
    assert manifest_of(tmp_path / "a")["shards"] == manifest_of(tmp_path / "b")["shards"]

    # An interrupted run: no manifest, the last shards missing, a half-written temp file from a dead writer.
    out = tmp_path / "b"
    (out / fmt.MANIFEST).unlink()
    for name in ("shard-00005.parquet", "shard-00007.parquet"):
        (out / name).unlink()
    (out / ".shard-00006.parquet.tmp-99999").write_bytes(b"PAR1 partial")
    (out / "shard-00006.parquet").unlink()
    assert_not_valid(out)
    result = ok(*args, "--out", out)
    assert scored_now(result) == (30, 4 + 4 + 2)  # shards 5, 6 (4 rows each) and 7 (2 rows)
    assert shard_hashes(out) == clean
    assert sorted(p.name for p in out.iterdir()) == sorted([*clean, fmt.MANIFEST, fmt.CARD, fmt.LOCK])  # no temp files left
    open_cache(out)
    assert scored_now(ok(*args, "--out", out)) == (30, 0)  # finished: nothing to redo


# ---------------------------------------------------------------------------------------------------------------
# 2. refusals


@pytest.fixture()
def finished(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(12, seed=13))
    out = tmp_path / "cache"
    ok("--model", llama_dir, "--data", data, "--out", out, "--rows-per-shard", 5)
    return data, out


@pytest.mark.parametrize("change", ["max_length", "truncation_mode", "model_weights", "model_and_tokenizer", "data"])
def test_rerun_with_a_different_job_is_refused_until_overwrite(
    llama_dir, llama_other_dir, gpt2_dir, finished, tmp_path, change
):
    data, out = finished
    before, old = dir_state(out), manifest_of(out)
    model, extra = llama_dir, []
    if change == "max_length":
        extra = ["--max-length", 64]
    elif change == "truncation_mode":
        extra = ["--truncation-mode", "keep_end"]
    elif change == "model_weights":
        model = llama_other_dir
    elif change == "model_and_tokenizer":
        model = gpt2_dir
    else:
        rows = pref_rows(12, seed=13)
        rows[7]["chosen"] = "sure no"
        data = write_jsonl(tmp_path / "edited.jsonl", rows)
    args = ["--model", model, "--data", data, "--out", out, "--rows-per-shard", 5, *extra]
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert "already holds a different cache" in result.output and "--overwrite" in result.output
    if change.startswith("model"):
        assert "model_hash" in result.output
    assert dir_state(out) == before  # the existing cache is untouched

    # An interrupted cache (shards without a manifest) from the other job is refused as well.
    (out / fmt.MANIFEST).unlink()
    result = cli(*args)
    assert result.exit_code == 2 and "--overwrite" in result.output, result.output

    result = ok(*args, "--overwrite")
    assert scored_now(result) == (12, 12)
    cache = open_cache(out)
    if change == "max_length":
        assert cache.manifest["encoding"]["max_length"] == 64
    if change.startswith("model"):
        from schemas.stamps import model_hash

        assert cache.stamps["model_hash"] == model_hash(model) != old["stamps"]["model_hash"]
    assert not list(out.glob(".*.tmp-*"))


def test_same_job_with_the_model_folder_copied_elsewhere_resumes(llama_dir, finished, tmp_path):
    data, out = finished
    before = shard_hashes(out)
    copy = shutil.copytree(llama_dir, tmp_path / "moved-model")  # the stamps follow content, not paths
    assert scored_now(ok("--model", copy, "--data", data, "--out", out, "--rows-per-shard", 5)) == (12, 0)
    assert shard_hashes(out) == before


def test_a_second_writer_is_refused_while_the_lock_is_held(llama_dir, finished):
    data, out = finished
    before = dir_state(out)
    args = ["--model", llama_dir, "--data", data, "--out", out, "--rows-per-shard", 5]
    with open(out / fmt.LOCK, "a+") as held:  # another writer (a separate open file description, as in a process)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for extra in ([], ["--overwrite"], ["--max-length", 64, "--overwrite"]):
            result = cli(*args, *extra)
            assert result.exit_code == 2, result.output
            assert "being written by another precompute-ref process" in result.output
            assert dir_state(out) == before  # --overwrite did not clear a cache someone else holds
    open_cache(out)
    assert scored_now(ok(*args)) == (12, 0)  # once the lock is free, the same job resumes (nothing to do)
