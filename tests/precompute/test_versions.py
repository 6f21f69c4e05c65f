"""Versions of an updated cache, from the user's side (issue 34 family 6, issue 36 themes 1 and 2): a no-op update
changes nothing; an interrupted update's shards are reclaimed by the next; --cache-version N for train-dpo and
audit-ref (and refused naming the versions kept); a resume across versions; a version whose manifest is gone is named
by file; an update takes the cache's settings; remedies that know --update; the version line of every report."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from conftest import (REPO, audit_ref, paused_in_shard, check_of, dir_state, fake_run, manifest_of, pref_rows, write_jsonl)
from conftest import precompute_cli as cli, precompute_ok as ok, scored_now
from schemas import format as fmt

ROWS, PER_SHARD = 24, 8
TRAIN = ["--use-cpu", "--per-device-train-batch-size", "4", "--learning-rate", "1e-3", "--logging-steps", "1",
         "--no-plot"]


def train(*args):
    from dpo.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def rows():
    return pref_rows(ROWS + 4, seed=61)


@pytest.fixture()
def base(llama_dir, rows, tmp_path):
    """A finished cache of the first 24 rows (3 shards of 8)."""
    out = tmp_path / "cache"
    ok("--model", llama_dir, "--data", write_jsonl(tmp_path / "v1.jsonl", rows[:ROWS]), "--out", out,
       "--rows-per-shard", PER_SHARD)
    return out


def update(llama_dir, data, out, *extra):
    return cli("--model", llama_dir, "--data", data, "--out", out, "--update", *extra)


def bad_row(i: int) -> dict:
    return {"id": f"bad{i}", "prompt": "why?", "chosen": 7 + i, "rejected": "no"}  # not text: a bad row


# ---------------------------------------------------------------------------------------------------------------
# issue 34 family 6


def test_a_no_op_update_over_data_with_other_bad_rows_changes_nothing(llama_dir, rows, tmp_path):
    out = tmp_path / "cache"
    ok("--model", llama_dir, "--data", write_jsonl(tmp_path / "v1.jsonl", [*rows[:ROWS], bad_row(1)]), "--out", out,
       "--rows-per-shard", PER_SHARD, "--on-bad-row", "skip")
    state = dir_state(out)
    other_bad = write_jsonl(tmp_path / "v1b.jsonl", [*rows[:ROWS], bad_row(2), bad_row(3)])
    for _ in range(2):  # and the same update again
        result = update(llama_dir, other_bad, out, "--on-bad-row", "skip")
        assert result.exit_code == 0, result.output
        assert scored_now(result) == (ROWS, 0) and dir_state(out) == state  # skipped.jsonl too
    code, report, output = audit_ref(out)
    assert code == 0, output
    assert check_of(report, "skipped_counts")["status"] == "PASS"


def test_an_interrupted_update_leaves_shards_no_version_owns_and_the_next_update_of_other_data_reclaims_them(
        llama_dir, rows, base, tmp_path):
    more = [{**r, "id": f"n{i:04d}"} for i, r in enumerate(pref_rows(20, seed=63))]
    killed_data = write_jsonl(tmp_path / "killed.jsonl", rows[:ROWS] + more)  # 3 new shards
    args = ["--model", llama_dir, "--data", killed_data, "--out", base, "--update", "--no-progress"]
    with paused_in_shard(args, 1, tmp_path / "paused", cwd=REPO):
        pass  # kill -9 in the middle of the second new shard
    left = sorted(p.name for p in base.glob("shard-v00002-*.parquet"))
    assert left == ["shard-v00002-00000.parquet"]  # the first new shard: named by no version
    code, _, output = audit_ref(base)
    assert code == 0, output  # version 1 still audits

    # Another update, of other data: one new row only. The killed update's shard holds other rows: reclaimed.
    other = write_jsonl(tmp_path / "other.jsonl", rows[:ROWS + 1])
    result = update(llama_dir, other, base)
    assert result.exit_code == 0, result.output
    assert scored_now(result) == (ROWS + 1, 1)
    manifest = manifest_of(base)
    assert manifest["version"] == 2 and manifest["update"]["added"] == [rows[ROWS]["id"]]
    code, report, output = audit_ref(base)
    assert code == 0, output
    assert sorted(p.name for p in base.glob("shard-v00002-*.parquet")) == ["shard-v00002-00000.parquet"]
    scratch = tmp_path / "scratch"
    ok("--model", llama_dir, "--data", other, "--out", scratch, "--rows-per-shard", PER_SHARD)
    assert manifest["stamps"]["mask_checksum"] == manifest_of(scratch)["stamps"]["mask_checksum"]


def test_an_unreachable_killed_update_shard_not_planned_now_is_removed(llama_dir, rows, base, tmp_path):
    """A shard of an interrupted update under a name this update does not write at all (it left more shards)."""
    import shutil

    shutil.copy(base / "shard-00000.parquet", base / "shard-v00002-00004.parquet")  # another update's leftover
    result = update(llama_dir, write_jsonl(tmp_path / "d.jsonl", rows[:ROWS + 1]), base)
    assert result.exit_code == 0, result.output
    assert "shard-v00002-00004.parquet" in result.output and "interrupted update" in result.output
    assert not (base / "shard-v00002-00004.parquet").exists()
    assert audit_ref(base)[0] == 0


@pytest.fixture()
def two_versions(llama_dir, rows, base, tmp_path):
    """Version 1: rows 0-23; version 2: rows 3-23 (3 removed) and 24-27 (4 added)."""
    v1 = write_jsonl(tmp_path / "v1-data.jsonl", rows[:ROWS])
    v2 = write_jsonl(tmp_path / "v2-data.jsonl", rows[3:ROWS + 4])
    assert update(llama_dir, v2, base).exit_code == 0
    return {"cache": base, "v1": v1, "v2": v2}


def test_training_on_version_1_after_version_2_removed_rows(llama_dir, two_versions, tmp_path):
    cache, v1 = two_versions["cache"], two_versions["v1"]
    refused = train("--model", llama_dir, "--data", v1, "--ref-cache", cache, "--output-dir", tmp_path / "r0",
                    *TRAIN, "--max-steps", "1")
    assert refused.exit_code == 2
    assert "version 2 of the cache removed them" in refused.output and "--cache-version 1" in refused.output
    result = train("--model", llama_dir, "--data", v1, "--ref-cache", cache, "--cache-version", "1",
                   "--output-dir", tmp_path / "r1", *TRAIN, "--max-steps", "1")
    assert result.exit_code == 0, result.output
    assert "cache version 1 of 2, kept as manifest-00001.json" in result.output  # the verified line
    run = json.loads((tmp_path / "r1" / "run-manifest.json").read_text())
    assert run["reference"]["cache"]["version"] == 1
    assert run["reference"]["verification"]["version"]["file"] == "manifest-00001.json"
    assert "| version | 1 |" in (tmp_path / "r1" / "README.md").read_text()  # the model card
    code, report, output = audit_ref(cache, "--run", tmp_path / "r1")
    assert code == 0 and check_of(report, "run_cache")["status"] == "PASS", output
    # a version that is not kept is refused naming those that are
    result = train("--model", llama_dir, "--data", v1, "--ref-cache", cache, "--cache-version", "5",
                   "--output-dir", tmp_path / "r5", *TRAIN, "--max-steps", "1")
    assert result.exit_code == 2 and "has no version 5" in result.output
    assert "2 (manifest.json), 1 (manifest-00001.json)" in result.output


def test_audit_and_show_take_cache_version_and_name_a_missing_version_manifest(llama_dir, rows, two_versions,
                                                                                tmp_path):
    cache = two_versions["cache"]
    code, report, output = audit_ref(cache, "--cache-version", "1")
    assert code == 0, output
    assert report["version"]["version"] == 1 and report["version"]["file"] == "manifest-00001.json"
    assert report["stats"]["rows"] == ROWS and "cache version 1 of 2" in output
    gone = rows[0]["id"]  # removed by version 2: shown from version 1
    from audit.cli import main

    shown = CliRunner().invoke(main, [str(cache), "--show", gone, "--cache-version", "1", "--tokenizer",
                                      str(llama_dir)], catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    assert gone in shown.output
    run = fake_run(tmp_path / "run", llama_dir, cache)  # a run of version 2
    (cache / "manifest-00001.json").rename(tmp_path / "away.json")
    code, report, output = audit_ref(cache, "--cache-version", "1")
    assert code == 2 and "manifest-00001.json is missing" in output and "2 (manifest.json)" in output
    code, report, output = audit_ref(cache, "--run", run)  # version 1's own shards now read as strays: said why
    assert code == 1 and "version 1: its manifest manifest-00001.json is missing" in output
    assert check_of(report, "run_cache")["status"] == "PASS"
    (tmp_path / "away.json").rename(cache / "manifest-00001.json")
    v1_run = tmp_path / "v1run"
    fake_run(v1_run, llama_dir, cache)
    record = json.loads((v1_run / "run-manifest.json").read_text())
    record["reference"]["cache"]["cache_id"] = manifest_of(cache)["history"][0]["cache_id"]  # trained on version 1
    record["reference"]["cache"]["stamps"] = json.loads((cache / "manifest-00001.json").read_text())["stamps"]
    (v1_run / "run-manifest.json").write_text(json.dumps(record))
    assert audit_ref(cache, "--run", v1_run)[0] == 0
    (cache / "manifest-00001.json").rename(tmp_path / "away.json")
    code, report, output = audit_ref(cache, "--run", v1_run)
    assert code == 1
    detail = check_of(report, "run_cache")["detail"]
    assert "version 1 of this cache" in detail and "manifest-00001.json is missing" in detail, detail


def test_a_resume_on_an_updated_cache(llama_dir, rows, base, tmp_path):
    """The run trains on rows 0-11. Version 2 adds rows: none of the run's changed, the resume continues. Version 3
    removes row 0 and version 4 adds it back (scored again): the resume is refused naming the versions and
    --cache-version; with --cache-version 2 it continues."""
    data = write_jsonl(tmp_path / "run-data.jsonl", rows[:12])
    out = tmp_path / "run"
    args = ["--model", llama_dir, "--data", data, "--ref-cache", base, *TRAIN, "--save-steps", "1", "--seed", "3"]
    assert train(*args, "--output-dir", out, "--max-steps", "1").exit_code == 0
    assert update(llama_dir, write_jsonl(tmp_path / "v2.jsonl", rows[:ROWS + 2]), base).exit_code == 0
    resumed = train(*args, "--output-dir", out, "--max-steps", "2", "--resume-from-checkpoint", out / "checkpoint-1")
    assert resumed.exit_code == 0, resumed.output
    assert "updated from version 1 to 2 since this checkpoint; none of this run's 12 rows changed" in resumed.output
    assert update(llama_dir, write_jsonl(tmp_path / "v3.jsonl", rows[1:ROWS + 2]), base).exit_code == 0
    assert update(llama_dir, write_jsonl(tmp_path / "v4.jsonl", rows[:ROWS + 2]), base).exit_code == 0
    refused = train(*args, "--output-dir", out, "--max-steps", "3", "--resume-from-checkpoint", out / "checkpoint-2")
    assert refused.exit_code == 2
    assert "updated from version 2 to 4 since this checkpoint" in refused.output
    # said as what the updates did (ux44b: added rows were called "changed"), with the count of this run's rows
    assert "and the updates between them added, removed or replaced 1 of this run's rows" in refused.output
    assert repr(rows[0]["id"]) in refused.output and "--cache-version 2" in refused.output
    resumed = train(*args, "--cache-version", "2", "--output-dir", out, "--max-steps", "3",
                    "--resume-from-checkpoint", out / "checkpoint-2")
    assert resumed.exit_code == 0, resumed.output


@pytest.mark.parametrize("edit", [{"file": "/etc/passwd"}, {"file": "../../etc/passwd"}, {"rows": -5},
                                  {"version": 1e40}, {"version": 7}, {"file": "manifest-00002.json"}])
def test_an_edited_history_entry_is_a_finding_not_passed_over(llama_dir, rows, base, tmp_path, edit):
    """Hostile pass: a history entry naming /etc/passwd, -5 rows or version 1e40 was carried forward by --update and
    passed by audit-ref (never read: only names of the version-file form are). The manifest rule says it."""
    grown = write_jsonl(tmp_path / "v2.jsonl", rows[:ROWS + 2])
    assert update(llama_dir, grown, base).exit_code == 0
    manifest = manifest_of(base)
    manifest["history"][0].update(edit)
    (base / fmt.MANIFEST).write_text(json.dumps(manifest))
    code, report, output = audit_ref(base)
    assert code == 1 and "the history was edited" in check_of(report, "manifest")["detail"], output
    refused = update(llama_dir, write_jsonl(tmp_path / "v3.jsonl", rows), base)
    assert refused.exit_code == 2 and "the history was edited" in refused.output, refused.output


def test_a_resume_with_data_edited_since_the_checkpoint_is_told_both_ways_on(llama_dir, rows, tmp_path):
    """UX pass: a run trained on version 1; a row edited and the cache updated with --replace-changed (version 2);
    resuming with the edited data was told `--cache-version 1`, which then refused the edited row with
    `--update --replace-changed` (done already): a loop. The refusal says this run's data is not the checkpoint's."""
    cache = tmp_path / "cache"
    data = write_jsonl(tmp_path / "p12.jsonl", rows[:12])
    assert ok("--model", llama_dir, "--data", data, "--out", cache).exit_code == 0
    out = tmp_path / "run"
    args = ["--model", llama_dir, "--ref-cache", cache, *TRAIN, "--save-steps", "1", "--output-dir", out]
    assert train(*args, "--data", data, "--max-steps", "1").exit_code == 0
    edited = [dict(r) for r in rows[:12]]
    edited[3]["chosen"] += " and more"
    edited_data = write_jsonl(tmp_path / "p12e.jsonl", edited)
    assert update(llama_dir, edited_data, cache, "--replace-changed").exit_code == 0
    refused = train(*args, "--data", edited_data, "--max-steps", "2", "--resume-from-checkpoint",
                    out / "checkpoint-1")
    assert refused.exit_code == 2, refused.output
    assert "updated from version 1 to 2 since this checkpoint" in refused.output
    assert "this run's data is not the data this checkpoint trained on" in refused.output, refused.output
    assert "resume with the data it trained on and --cache-version 1, or train on this data in a new run" in \
        refused.output
    looped = train(*args, "--data", edited_data, "--cache-version", "1", "--max-steps", "2",
                   "--resume-from-checkpoint", out / "checkpoint-1")  # closing pass: was told --update again
    assert looped.exit_code == 2, looped.output
    assert "version 2, the cache's current one, holds them as this data has them" in looped.output, looped.output
    assert "this checkpoint trained on version 1 resumes with the data it trained on" in looped.output
    assert "--replace-changed`" not in looped.output
    resumed = train(*args, "--data", data, "--cache-version", "1", "--max-steps", "2", "--resume-from-checkpoint",
                    out / "checkpoint-1")
    assert resumed.exit_code == 0, resumed.output


# ---------------------------------------------------------------------------------------------------------------
# a sliding-window model: the cache's batching mode cannot take longer rows


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory, tokenizer):
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from conftest import save_checkpoint

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=24, bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           attn_implementation="sdpa")
    return save_checkpoint(MistralForCausalLM(config).eval(), tokenizer, tmp_path_factory.mktemp("mistral-sw"))


def test_an_update_with_rows_longer_than_the_sliding_window_scores_them_exactly(sliding_dir, tmp_path):
    short = [{"id": f"s{i}", "prompt": "yes?", "chosen": "ok", "rejected": "no"} for i in range(6)]
    long_text = " ".join(["the cat sat on the mat and then it ran away"] * 4)
    longer = [{"id": f"l{i}", "prompt": long_text + f" {i}?", "chosen": "sure " + long_text, "rejected": "hmm no"}
              for i in range(3)]
    out = tmp_path / "cache"
    made = ok("--model", sliding_dir, "--data", write_jsonl(tmp_path / "v1.jsonl", short), "--out", out,
              "--rows-per-shard", 4, "--batching", "kv_cache")
    assert manifest_of(out)["computation"]["mode"] == "kv_cache", made.output
    grown = write_jsonl(tmp_path / "v2.jsonl", short + longer)
    result = update(sliding_dir, grown, out)  # --batching and --rows-per-shard: the cache's
    assert result.exit_code == 0, result.output
    assert "which the new rows cannot use" in result.output
    manifest = manifest_of(out)
    assert manifest["version"] == 2 and manifest["computation"]["mode"] == "kv_cache"
    new = [e for e in manifest["shards"] if e["file"].startswith("shard-v00002-")]
    assert new and all(e["computation"]["mode"] in ("full_forward", "single") for e in new)
    code, report, output = audit_ref(out, "--model", sliding_dir, "--all")
    assert code == 0, output
    assert check_of(report, "replay")["status"] == "PASS"  # the model's own forward, row by row
    assert audit_ref(out, "--cache-version", "1")[0] == 0  # version 1 kept as it was


# ---------------------------------------------------------------------------------------------------------------
# issue 36 theme 1: --update takes the cache's settings; remedies that know --update


def test_update_takes_the_cache_settings_and_refuses_only_one_that_differs(llama_dir, rows, tmp_path):
    out = tmp_path / "cache"
    ok("--model", llama_dir, "--data", write_jsonl(tmp_path / "v1.jsonl", rows[:ROWS]), "--out", out,
       "--rows-per-shard", PER_SHARD, "--top-k", 4, "--max-length", 64)
    grown = write_jsonl(tmp_path / "v2.jsonl", rows)
    state = dir_state(out)
    refused = update(llama_dir, grown, out, "--top-k", 8)
    assert refused.exit_code == 2 and "pass --top-k 4" in refused.output, refused.output
    refused = update(llama_dir, grown, out, "--max-length", 128)
    assert refused.exit_code == 2 and "pass --max-length 64" in refused.output, refused.output
    assert dir_state(out) == state
    result = update(llama_dir, grown, out)  # none of them given
    assert result.exit_code == 0, result.output
    assert "--rows-per-shard 8" in result.output and "--top-k 4" in result.output
    assert "--max-length 64" in result.output
    assert fmt.top_k_of(manifest_of(out)["computation"]) == 4 and audit_ref(out)[0] == 0
    assert update(llama_dir, grown, out, "--top-k", 4, "--rows-per-shard", PER_SHARD).exit_code == 0  # same: fine


def test_train_dpo_remedies_name_update(llama_dir, rows, base, tmp_path):
    lacks = write_jsonl(tmp_path / "more.jsonl", rows[:ROWS + 1])
    result = train("--model", llama_dir, "--data", lacks, "--ref-cache", base, "--output-dir", tmp_path / "a",
                   *TRAIN, "--max-steps", "1")
    assert result.exit_code == 2 and f"--out {base} --update" in result.output, result.output
    assert "--replace-changed" not in result.output
    edited = [dict(r) for r in rows[:ROWS]]
    edited[5]["chosen"] += " and more"
    result = train("--model", llama_dir, "--data", write_jsonl(tmp_path / "edited.jsonl", edited), "--ref-cache",
                   base, "--output-dir", tmp_path / "b", *TRAIN, "--max-steps", "1")
    assert result.exit_code == 2 and "--update --replace-changed" in result.output, result.output
    # the two checksums labelled by their owners, the cache's first (found by the UX pass: 'expected' / 'found')
    lines = result.output.splitlines()
    assert any(line.strip().startswith("the cache:") for line in lines), result.output
    assert any(line.strip().startswith("this run:") for line in lines), result.output
    assert not any(line.strip().startswith(("expected:", "found:")) for line in lines), result.output


def test_a_resume_with_the_checkpoints_own_data_after_an_update_replaced_its_rows_names_the_version(
        llama_dir, rows, base, tmp_path):
    """Found by the UX pass: version 2 replaced an edited row (--update --replace-changed); resuming a run of
    version 1 with its own, unedited data was told `--update --replace-changed` (which would make a version 3 that
    reverts the edit). The remedy is the version that holds the rows as this data has them: --cache-version 1, which
    then resumes."""
    data = write_jsonl(tmp_path / "run-data.jsonl", rows[:12])
    out = tmp_path / "run"
    args = ["--model", llama_dir, "--data", data, "--ref-cache", base, *TRAIN, "--save-steps", "1", "--seed", "3"]
    assert train(*args, "--output-dir", out, "--max-steps", "1").exit_code == 0
    edited = [dict(r) for r in rows[:ROWS]]
    edited[5]["chosen"] += " and more"
    assert update(llama_dir, write_jsonl(tmp_path / "v2.jsonl", edited), base, "--replace-changed").exit_code == 0
    refused = train(*args, "--output-dir", out, "--max-steps", "2", "--resume-from-checkpoint", out / "checkpoint-1")
    assert refused.exit_code == 2, refused.output
    assert "version 2 of the cache replaced them" in refused.output, refused.output
    assert "pass --cache-version 1" in refused.output and "--replace-changed`" not in refused.output
    # issue 36: the first line says it in words (which row, which version replaced it, which one the checkpoint
    # trained on), with no checksums
    first = refused.output.strip().splitlines()[0]
    assert first == (f"error: row {rows[5]['id']!r} was replaced in version 2 of the cache (precompute-ref --update "
                     f"--replace-changed); this checkpoint ({out / 'checkpoint-1'}) trained on version 1, which holds "
                     "it as this data has it"), refused.output
    assert not any(line.strip().startswith(("the cache:", "this run:")) for line in refused.output.splitlines())
    resumed = train(*args, "--cache-version", "1", "--output-dir", out, "--max-steps", "2",
                    "--resume-from-checkpoint", out / "checkpoint-1")
    assert resumed.exit_code == 0, resumed.output
    # data edited otherwise than any version holds it: the edit's own remedy, as before
    other = [dict(r) for r in rows[:12]]
    other[5]["chosen"] += " yet another way"
    result = train("--model", llama_dir, "--data", write_jsonl(tmp_path / "other.jsonl", other), "--ref-cache", base,
                   "--output-dir", tmp_path / "c", *TRAIN, "--max-steps", "1")
    assert result.exit_code == 2 and "--update --replace-changed" in result.output, result.output


# ---------------------------------------------------------------------------------------------------------------
# issue 36 theme 2: the version in every report


def test_every_report_names_the_version_and_its_history(llama_dir, rows, two_versions, tmp_path):
    cache = two_versions["cache"]
    line = "cache version 2 (made by precompute-ref --update"
    counts = "4 rows added, 3 removed, 0 replaced"
    code, report, output = audit_ref(cache)
    assert code == 0 and line in output and counts in output, output
    assert "format version" not in output  # the file format is not the cache's version
    assert report["version"]["version"] == 2 and report["version"]["current"] == 2
    assert [h["version"] for h in report["version"]["history"]] == [1, 2]
    card = (cache / fmt.CARD).read_text()
    assert line in card and counts in card and "manifest-00001.json" in card
    result = train("--model", llama_dir, "--data", two_versions["v2"], "--ref-cache", cache, "--output-dir",
                   tmp_path / "run", *TRAIN, "--max-steps", "1")
    assert result.exit_code == 0, result.output
    assert line in result.output and counts in result.output  # the verified line
    run = json.loads((tmp_path / "run" / "run-manifest.json").read_text())
    assert run["reference"]["cache"]["version"] == 2
    assert counts in run["reference"]["verification"]["version"]["line"]
    model_card = (tmp_path / "run" / "README.md").read_text()
    assert line in model_card and counts in model_card


def test_a_cache_never_updated_says_so(base):
    code, report, output = audit_ref(base)
    assert code == 0 and "cache version 1 (the cache as first made" in output and "never updated" in output
    assert report["version"]["version"] == 1 and report["version"]["file"] == "manifest.json"


def test_cache_version_without_a_cache_is_refused(llama_dir, rows, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", rows[:8])
    result = train("--model", llama_dir, "--data", data, "--ref-model", llama_dir, "--cache-version", "1",
                   "--output-dir", tmp_path / "run", *TRAIN, "--max-steps", "1")
    assert result.exit_code == 2 and "--cache-version 1 names a version of the --ref-cache" in result.output
    assert not (tmp_path / "run").exists()


def test_an_update_that_empties_a_shard_and_a_no_op_update(llama_dir, rows, base, tmp_path):
    """Data that drops every row of the first shard: that shard is left out of the new version (no crash on an empty
    selection), and audit-ref passes it; then the same data again: nothing to change, said so, and no version named
    that is never written (found by the UX pass)."""
    data = write_jsonl(tmp_path / "v2.jsonl", rows[PER_SHARD:ROWS])
    result = update(llama_dir, data, base)
    assert result.exit_code == 0, result.output
    manifest = manifest_of(base)
    assert manifest["version"] == 2 and sum(e["rows"] for e in manifest["shards"]) == ROWS - PER_SHARD
    assert audit_ref(base)[0] == 0
    again = update(llama_dir, data, base)
    assert again.exit_code == 0, again.output
    assert "nothing to change" in again.output and "version 3" not in again.output
    assert manifest_of(base)["version"] == 2


def test_an_update_killed_between_its_manifest_and_its_card_is_finished_by_the_same_command(llama_dir, rows, base,
                                                                                            tmp_path, monkeypatch):
    """Hostile pass (h44): an --update killed after its manifest, before its card, left the card of the version before
    (its stamps), which the rerun refused as 'not provably this cache's', and so did --overwrite and audit-ref's
    remedy. The card of a version the cache keeps is the cache's own: the same command finishes the update."""
    import precompute.job as job

    def killed(*a, **k):
        raise KeyboardInterrupt

    grown = write_jsonl(tmp_path / "v2.jsonl", rows)
    monkeypatch.setattr(job, "write_card", killed)
    stopped = update(llama_dir, grown, base)
    monkeypatch.undo()
    assert stopped.exit_code == 130 and manifest_of(base).get("version") == 2, stopped.output
    again = update(llama_dir, grown, base)
    assert again.exit_code == 0, again.output
    code, report, output = audit_ref(base)
    assert code == 0 and check_of(report, "card")["status"] == "PASS", output
