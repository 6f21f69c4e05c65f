"""schemas/run_manifest.py without training: the run manifest and checkpoint record are read back or refused with
their path, a resume against another reference names what differs, and audit-ref --run finds the role of a cache in
a run (its train or eval cache) or says why it is neither."""

from __future__ import annotations

import json

import pytest

from schemas.run_manifest import (CACHE_MANIFEST, CHECKPOINT_RECORD, RUN_KIND, RUN_MANIFEST, RunManifestError,
                                  build_run_manifest, cache_record, read_checkpoint_record, read_run_manifest,
                                  reference_findings, reference_record, run_cache_findings, write_json)

STAMPS = {"model_hash": "m" * 64, "tokenizer_hash": "t" * 64, "mask_checksum": "c" * 64}


def make_cache(root, shard_sha="a", **extra):
    """A cache manifest whose content (cache_id) is set by its one shard's sha256; `extra`: further keys."""
    root.mkdir(parents=True, exist_ok=True)
    manifest = {"stamps": STAMPS, "encoding": {"max_length": 8},
                "shards": [{"file": "shard-00000.parquet", "rows": 3, "sha256": shard_sha * 64}], **extra}
    (root / CACHE_MANIFEST).write_text(json.dumps(manifest))
    return root


def record(train, eval_cache=None, live=None, data="d1"):
    return reference_record(train_cache=train, eval_cache=eval_cache, live_model=live, data_fingerprint=data,
                            eval_data_fingerprint=None)


def test_run_manifest_round_trip_and_refusals(tmp_path):
    ref = record(cache_record(make_cache(tmp_path / "cache"), STAMPS))
    run = build_run_manifest(reference=ref, initial_model={}, data={}, eval_data=None, config={"seed": 7},
                             software={}, result={"steps": 2}, final_model_hash="f", finished_at="now", peft={"r": 8})
    write_json(tmp_path / RUN_MANIFEST, run)
    back = read_run_manifest(tmp_path)
    assert back == json.loads(json.dumps(run)) and back["kind"] == RUN_KIND and back["seed"] == 7 and back["peft"]
    assert not list(tmp_path.glob(f".{RUN_MANIFEST}.tmp"))
    with pytest.raises(RunManifestError, match=rf"{tmp_path / 'none'}.*missing or not a train-dpo run manifest"):
        read_run_manifest(tmp_path / "none")
    write_json(tmp_path / RUN_MANIFEST, {**run, "kind": "something-else"})
    with pytest.raises(RunManifestError, match="is not a train-dpo run manifest"):
        read_run_manifest(tmp_path)


def test_checkpoint_record_missing_or_not_json_is_refused(tmp_path):
    with pytest.raises(RunManifestError, match="does not say which reference and data it was trained on"):
        read_checkpoint_record(tmp_path)
    (tmp_path / CHECKPOINT_RECORD).write_text("[1, 2]")
    with pytest.raises(RunManifestError, match="is not a reference record"):
        read_checkpoint_record(tmp_path)


def test_a_resume_against_another_reference_names_what_differs(tmp_path):
    cache = cache_record(make_cache(tmp_path / "cache"), STAMPS)
    moved = {**cache, "path": "/elsewhere"}  # the same cache at another path: only content counts
    assert reference_findings(record(cache), record(moved)) == []
    other = cache_record(make_cache(tmp_path / "other", "b"), STAMPS)
    found = reference_findings(record(cache), record(other, data="d2"))
    assert [f.message for f in found] == ["the checkpoint was trained with another reference cache (--ref-cache)",
                                          "the checkpoint was trained with another training data (--data)"]
    assert found[1].expected == "data fingerprint d1" and found[1].found == "data fingerprint d2"
    assert "--ref-cache" in found[0].remedy
    restamped = {**cache, "stamps": {**STAMPS, "model_hash": "x" * 64}}
    assert [f.message for f in reference_findings(record(cache), record(restamped))] == [
        "the checkpoint was trained with another reference cache (--ref-cache)"]


def test_run_cache_role_or_what_differs(tmp_path):
    train, evaluation = make_cache(tmp_path / "train"), make_cache(tmp_path / "eval", "e")
    run = {"reference": record(cache_record(train, STAMPS), eval_cache=cache_record(evaluation, STAMPS))}
    assert run_cache_findings(run, train, STAMPS) == ("cache", [])
    assert run_cache_findings(run, evaluation, STAMPS) == ("eval_cache", [])
    stranger = make_cache(tmp_path / "stranger", "s")
    role, found = run_cache_findings(run, stranger, {**STAMPS, "mask_checksum": "z" * 64})
    assert role is None and len(found) == 1
    assert "names a cache with cache_id" in found[0].message
    assert "its stamps mask_checksum differ" in found[0].message
    live = {"reference": record(None, live="org/ref")}
    assert run_cache_findings(live, train, STAMPS)[1][0].message == (
        "the run was trained against a live reference, not a cache")


def test_a_cache_is_named_by_its_content_not_its_manifest_bytes(tmp_path):
    """Issue 22, item 7: a manifest rewritten with another created_at, software or paths (a no-op rerun,
    --overwrite, another cwd) is the same cache for a resume and for audit-ref --run; other shard files are not."""
    from schemas.run_manifest import cache_id, same_cache

    cache = make_cache(tmp_path / "cache", created_at="then", software={"refcache": "1"}, model={"path": "m"})
    recorded = cache_record(cache, STAMPS)
    make_cache(cache, created_at="now", software={"refcache": "2"}, model={"path": "/abs/m"}, source={"data": "x"})
    now = cache_record(cache, STAMPS)
    assert now["manifest_sha256"] != recorded["manifest_sha256"] and now["cache_id"] == recorded["cache_id"]
    assert reference_findings(record(recorded), record(now)) == []
    run = {"reference": record(recorded)}
    assert run_cache_findings(run, cache, STAMPS) == ("cache", [])
    manifest = json.loads((cache / CACHE_MANIFEST).read_text())
    for edit in (lambda m: m["shards"][0].update(sha256="f" * 64), lambda m: m["shards"][0].update(file="x.parquet"),
                 lambda m: m["encoding"].update(max_length=9), lambda m: m["stamps"].update(model_hash="x" * 64),
                 lambda m: m["shards"].append(dict(m["shards"][0]))):
        other = json.loads(json.dumps(manifest))
        edit(other)
        assert cache_id(other) != cache_id(manifest)
    assert not same_cache(recorded, {**recorded, "cache_id": "0" * 64})


def test_a_record_from_before_cache_id_is_compared_by_manifest_sha256(tmp_path):
    cache = make_cache(tmp_path / "cache")
    old = {k: v for k, v in cache_record(cache, STAMPS).items() if k != "cache_id"}
    assert reference_findings(record(old), record(cache_record(cache, STAMPS))) == []
    make_cache(cache, created_at="later")  # the same content, other bytes: an old record cannot know that
    assert [f.message for f in reference_findings(record(old), record(cache_record(cache, STAMPS)))] == [
        "the checkpoint was trained with another reference cache (--ref-cache)"]
    role, found = run_cache_findings({"reference": record(old)}, cache, STAMPS)
    assert role is None and "names a cache manifest with sha256" in found[0].message


def test_run_record_is_read_back_and_a_forged_or_linked_one_refused(tmp_path):
    """Issue 22 item 6: the output dir's run record (which run its checkpoints belong to)."""
    from schemas.run_manifest import RUN_RECORD, read_run_record, run_record, write_json

    write_json(tmp_path / RUN_RECORD, run_record("f" * 32, "2026-01-01T00:00:00+00:00"))
    assert read_run_record(tmp_path)["run_id"] == "f" * 32
    (tmp_path / "other").mkdir()
    write_json(tmp_path / "other" / RUN_RECORD, {"kind": "something-else", "run_id": "f" * 32})
    with pytest.raises(RunManifestError, match="is not a train-dpo run record"):
        read_run_record(tmp_path / "other")
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / RUN_RECORD).symlink_to(tmp_path / RUN_RECORD)
    with pytest.raises(RunManifestError, match="a symbolic link"):
        read_run_record(tmp_path / "linked")
    with pytest.raises(RunManifestError, match="is missing"):
        read_run_record(tmp_path / "nowhere")
