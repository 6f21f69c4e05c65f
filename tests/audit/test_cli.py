"""audit/cli.py (and the checks of audit/cache.py and audit/runs.py it runs), audit-ref in process (click's
CliRunner): a clean cache passes every check; each corruption fails exactly the check that owns it; usage errors and
unreadable caches exit 2. The replay on the shipped data/ model: test_replay.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import audit_ref as audit, build_llama, check_of as check, edit_manifest, float32_sum, pref_rows
from conftest import fake_run, precompute_in_process as precompute, rewrite_shard, save_checkpoint, statuses
from conftest import write_jsonl
from audit.cli import SECTIONS
from schemas import format as fmt

ALL_CHECKS = [n for names in SECTIONS.values() for n in names]
TOP_K_CHECKS = [n for n in ALL_CHECKS if n.startswith(("top_k_", "replay_top_k"))]  # SKIP: a cache without top-k
BAD_ROWS = [{"id": "bad-empty", "prompt": "what?", "chosen": "", "rejected": "no"},
            {"id": "bad-missing", "prompt": "why?", "rejected": "because"}]

# ---------------------------------------------------------------------------------------------------------------
# fixtures: one clean cache (3 shards of 10/10/4 rows, 2 skipped rows), another cache, other checkpoints, runs


@pytest.fixture(scope="module")
def world(tmp_path_factory, llama_dir, tokenizer):
    from transformers import AutoTokenizer

    base = tmp_path_factory.mktemp("audit")
    w = {"llama": llama_dir, "data": write_jsonl(base / "prefs.jsonl", pref_rows(24) + BAD_ROWS)}
    w["cache"] = precompute(llama_dir, w["data"], base / "cache")
    w["other_cache"] = precompute(llama_dir, write_jsonl(base / "other.jsonl", pref_rows(24, seed=1)), base / "other")
    w["other_model"] = save_checkpoint(build_llama(len(tokenizer), seed=1), tokenizer, base / "other-model")
    w["other_tokenizer"] = base / "other-tokenizer"
    shutil.copytree(llama_dir, w["other_tokenizer"])
    tok = AutoTokenizer.from_pretrained(w["other_tokenizer"])
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
    tok.save_pretrained(w["other_tokenizer"])
    w["run"] = fake_run(base / "run", llama_dir, w["cache"])
    w["run_other"] = fake_run(base / "run-other", llama_dir, w["other_cache"])
    return w


@pytest.fixture()
def cache(world, tmp_path) -> Path:
    return Path(shutil.copytree(world["cache"], tmp_path / "cache"))


# ---------------------------------------------------------------------------------------------------------------
# a clean cache


def test_clean_cache_passes_every_check(world, cache):
    code, report, output = audit(cache, "--model", world["llama"], "--data", world["data"], "--run", world["run"],
                                 "--all")
    assert code == 0, output
    # run_kl_control: the run's β was fixed, nothing to recompute (issue 35)
    assert statuses(report) == {n: "SKIP" if n in TOP_K_CHECKS + ["run_kl_control"] else "PASS" for n in ALL_CHECKS}
    assert report["result"] == "PASS" and report["failed"] == []
    replay = check(report, "replay")["info"]
    assert replay["rows"] == 24 and replay["token_max_abs_diff"] <= 1e-4 and replay["tolerance"] == 1e-4
    assert report["stats"]["rows"] == 24 and [s["rows"] for s in report["stats"]["logprobs_per_shard"]] == [10, 10, 4]
    tokens = {t["part"]: t for t in report["stats"]["tokens"]}
    assert tokens["completion"]["total"] == tokens["chosen"]["total"] + tokens["rejected"]["total"]
    assert report["made"]["created_at"] and report["made"]["software"]["refcache"]
    for title in ("Cache integrity", "Reference model", "Data", "Training run", "Tokens", "Log-probs per shard"):
        assert title in output
    assert output.rstrip().splitlines()[-1].startswith("PASS (18 passed, 0 failed, 7 skipped)")


def test_without_extras_the_cache_checks_pass_and_the_rest_is_skipped(cache):
    code, report, _ = audit(cache)
    assert code == 0
    assert statuses(report) == {n: "PASS" if n in SECTIONS["cache"] and n not in TOP_K_CHECKS else "SKIP"
                                for n in ALL_CHECKS}
    assert "2 skipped row(s)" in check(report, "skipped_counts")["detail"]


def test_the_card_check_names_what_differs_and_skips_a_cache_without_a_card(world, cache):
    """A card of another cache fails naming the stamps and cache_id that differ (with the remedy); a cache made before
    cards (no README.md) passes, its card check skipped; a card beside a damaged manifest waits for the manifest."""
    card_of_another_cache(world, cache)
    code, report, _ = audit(cache)
    detail = check(report, "card")["detail"]
    assert code == 1 and "'refcache' differs from the manifest" in detail and "cache_id" in detail, detail
    assert "mask_checksum" in detail and "precompute-ref" in detail
    (cache / fmt.CARD).unlink()
    code, report, output = audit(cache)
    assert code == 0 and check(report, "card")["status"] == "SKIP" and "no dataset card" in output, output
    shutil.copy(world["cache"] / fmt.CARD, cache / fmt.CARD)
    edit_cache_checksum(world, cache)
    code, report, _ = audit(cache)
    assert statuses(report)["card"] == "SKIP" and "cache_checksum" in check(report, "card")["detail"]


# ---------------------------------------------------------------------------------------------------------------
# corruptions: each fails exactly the check that owns it


def flip_byte(w, cache):
    path = cache / "shard-00001.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def replace_shard(w, cache):
    shutil.copy(w["other_cache"] / "shard-00001.parquet", cache / "shard-00001.parquet")


def edit_row_keep_metadata(w, cache):
    def edit(rows):
        ids = rows[3]["prompt_input_ids"]
        ids[-1] = ids[-1] + 1 if ids[-1] < 250 else ids[-1] - 1
    rewrite_shard(cache, "shard-00001.parquet", edit)


def edit_manifest_stamp(w, cache):
    edit_manifest(cache, lambda m: m["stamps"].update(model_hash="0" * 64))


def remove_shard(w, cache):
    (cache / "shard-00002.parquet").unlink()


def add_shard(w, cache):
    shutil.copy(cache / "shard-00000.parquet", cache / "shard-00003.parquet")


def edit_logprob(w, cache):
    rewrite_shard(cache, "shard-00000.parquet", lambda rows: rows[2]["chosen_logps"].__setitem__(0, -7.5))


def other_model(w, cache):
    return ["--model", w["other_model"], "--sample", 4]


def other_tokenizer(w, cache):
    return ["--model", w["other_tokenizer"], "--sample", 4]


def edit_data(w, cache):
    rows = pref_rows(24) + BAD_ROWS
    rows[5]["chosen"] = "sure the sky is green"
    del rows[7]
    rows.append({"id": "r9999", "prompt": "new?", "chosen": "yes", "rejected": "no"})
    return ["--model", w["llama"], "--sample", 0, "--data", write_jsonl(cache.parent / "edited.jsonl", rows)]


def run_on_other_cache(w, cache):
    return ["--run", w["run_other"]]


def duplicate_id(w, cache):
    rewrite_shard(cache, "shard-00002.parquet", lambda rows: rows[1].update(id="r0003"), ids=True)


def positive_logprob(w, cache):
    def edit(rows):
        rows[4]["rejected_logps"][1] = 0.25
        rows[4]["rejected_logp"] = float32_sum(rows[4]["rejected_logps"])
    rewrite_shard(cache, "shard-00001.parquet", edit)


def nan_logprob(w, cache):
    def edit(rows):
        rows[0]["chosen_logps"][0] = float("nan")
        rows[0]["chosen_logp"] = float("nan")
    rewrite_shard(cache, "shard-00002.parquet", edit)


def drop_logprob(w, cache):
    def edit(rows):
        rows[6]["rejected_logps"].pop()
        rows[6]["rejected_logp"] = float32_sum(rows[6]["rejected_logps"])
    rewrite_shard(cache, "shard-00000.parquet", edit)


def swap_rows(w, cache):
    rewrite_shard(cache, "shard-00000.parquet", lambda rows: rows.__setitem__(slice(0, 2), rows[1::-1]))


def edit_cache_checksum(w, cache):
    edit_manifest(cache, lambda m: m["stamps"].update(mask_checksum="0" * 64))


def drop_skipped_line(w, cache):
    path = cache / fmt.SKIPPED
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))


def card_without_a_shard(w, cache):
    """The dataset card edited with huggingface_hub's own card API: its configs no longer name the last shard."""
    from huggingface_hub import DatasetCard

    card = DatasetCard.load(cache / fmt.CARD)
    card.data.configs[0]["data_files"][0]["path"].pop()
    card.save(cache / fmt.CARD)


def card_of_another_cache(w, cache):
    shutil.copy(w["other_cache"] / fmt.CARD, cache / fmt.CARD)


def alter_run_checkpoint(w, cache):
    run = Path(shutil.copytree(w["run"], cache.parent / "run"))
    weights = run / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    return ["--run", run]


CORRUPTIONS = [  # (corruption, failing checks, shard and row of the first failure or None)
    (flip_byte, {"shard_files"}, ("shard-00001.parquet", None)),
    (replace_shard, {"shard_files"}, ("shard-00001.parquet", None)),
    (edit_row_keep_metadata, {"row_checksums"}, ("shard-00001.parquet", 3)),
    (edit_manifest_stamp, {"shard_stamps"}, ("shard-00000.parquet", None)),
    (remove_shard, {"shard_files"}, ("shard-00002.parquet", None)),
    (add_shard, {"shard_files"}, ("shard-00003.parquet", None)),
    (edit_logprob, {"sums"}, ("shard-00000.parquet", 2)),
    (other_model, {"model_hash"}, None),
    (other_tokenizer, {"tokenizer_hash"}, None),
    (edit_data, {"data_rows"}, ("shard-00000.parquet", 5)),
    (run_on_other_cache, {"run_cache"}, None),
    (duplicate_id, {"unique_ids"}, ("shard-00002.parquet", 1)),
    (positive_logprob, {"logprob_values"}, ("shard-00001.parquet", 4)),
    (nan_logprob, {"logprob_values"}, ("shard-00002.parquet", 0)),
    (drop_logprob, {"list_lengths"}, ("shard-00000.parquet", 6)),
    (swap_rows, {"shard_checksums"}, ("shard-00000.parquet", None)),
    (edit_cache_checksum, {"cache_checksum"}, None),
    (drop_skipped_line, {"skipped_counts"}, None),
    (card_without_a_shard, {"card"}, None),
    (card_of_another_cache, {"card"}, None),
    (alter_run_checkpoint, {"run_final_hash"}, None),
]


@pytest.mark.parametrize("corrupt, failing, where", CORRUPTIONS, ids=[c[0].__name__ for c in CORRUPTIONS])
def test_each_corruption_fails_exactly_its_check(world, cache, corrupt, failing, where):
    args = corrupt(world, cache) or []
    code, report, output = audit(cache, *args)
    assert code == 1, output
    assert {n for n, s in statuses(report).items() if s == "FAIL"} == failing, output
    assert set(report["failed"]) == failing
    first = check(report, next(iter(failing)))
    if where:
        assert (first["shard"], first["row"]) == where
    assert output.rstrip().splitlines()[-1].startswith("FAIL: " + next(iter(failing)))
    line = next(ln for ln in output.splitlines() if ln.strip().startswith(first["name"] + " "))
    assert "FAIL" in line and (where is None or where[0] in line)


def test_data_check_lists_changed_removed_and_added_rows(world, cache):
    code, report, _ = audit(cache, *edit_data(world, cache))
    info = check(report, "data_rows")["info"]
    assert (info["changed"], info["removed"], info["added"]) == (["r0005"], ["r0007"], ["r9999"])
    assert statuses(report)["replay"] == "SKIP"
    # the remedy is runtime/remedies.py's: an update that scores the edited row again brings the cache to this data
    assert f"--out {cache} --update --replace-changed`" in check(report, "data_rows")["detail"]


def test_replay_and_data_wait_for_the_hashes(world, cache):
    _, report, _ = audit(cache, "--model", world["other_model"], "--data", world["data"])
    assert statuses(report)["replay"] == "SKIP"
    _, report, _ = audit(cache, "--model", world["other_tokenizer"], "--data", world["data"], "--sample", 3)
    assert statuses(report)["data_rows"] == "SKIP" and statuses(report)["replay"] == "PASS"
    assert check(report, "replay")["info"]["rows"] == 3


# ---------------------------------------------------------------------------------------------------------------
# exit code 2


@pytest.mark.parametrize("damage", ["missing", "not_json", "future_version"])
def test_unreadable_manifest_exits_2(cache, damage):
    path = cache / fmt.MANIFEST
    if damage == "missing":
        path.unlink()
    elif damage == "not_json":
        path.write_text("{not json")
    else:
        path.write_text(json.dumps({**json.loads(path.read_text()), "format_version": 99}))
    code, report, output = audit(cache)
    assert code == 2 and report is None
    assert "error:" in output


@pytest.mark.parametrize("args", [["--data", "{data}"], ["--sample", "3", "--all"], ["--run", "{cache}"],
                                  ["--tolerance", "0"]])
def test_usage_errors_exit_2(world, cache, args):
    args = [a.format(data=world["data"], cache=cache) for a in args]
    code, report, _ = audit(cache, *args)
    assert code == 2 and report is None


def test_console_script_exit_codes(cache):
    script = Path(sys.executable).parent / "audit-ref"
    if not script.exists():
        pytest.skip("audit-ref is not installed in this environment (pip install -e .)")
    assert subprocess.run([script, cache], capture_output=True).returncode == 0
    flip_byte(None, cache)
    assert subprocess.run([script, cache], capture_output=True).returncode == 1
    (cache / fmt.MANIFEST).unlink()
    done = subprocess.run([script, cache], capture_output=True, text=True)
    assert done.returncode == 2 and "no manifest.json" in done.stderr


def test_model_and_tokenizer_take_a_hub_id_as_the_other_commands_do(world, cache, tmp_path):
    """audit-ref --model (and --tokenizer, --data) resolve a hub id through the local Hugging Face cache, offline,
    as precompute-ref and train-dpo do (runtime/hub.py); an id that is not there is a usage error saying how to get
    it."""
    from support import hub_snapshot

    files = {p.name: p for p in Path(world["llama"]).iterdir() if p.is_file()}
    hub_snapshot("model", "acme/audit-ref-model", files)
    hub_snapshot("dataset", "acme/audit-ref-data", {"train.jsonl": Path(world["data"])})
    code, report, output = audit(cache, "--model", "acme/audit-ref-model", "--data", "acme/audit-ref-data",
                                 "--sample", 2)
    assert code == 0, output
    assert {n: check(report, n)["status"] for n in ("model_hash", "tokenizer_hash", "replay", "data_rows")} == {
        "model_hash": "PASS", "tokenizer_hash": "PASS", "replay": "PASS", "data_rows": "PASS"}
    from click.testing import CliRunner

    from audit.cli import main

    shown = CliRunner().invoke(main, [str(cache), "--show", "0", "--tokenizer", "acme/audit-ref-model"])
    assert shown.exit_code == 0 and "the prompt ends here" in shown.output, shown.output
    missing = CliRunner().invoke(main, [str(cache), "--model", "acme/not-downloaded"])
    assert missing.exit_code == 2 and "hf download acme/not-downloaded" in missing.output, missing.output


def test_the_reports_options_name_local_places_absolutely(dpo_cache, dpo_data, llama_dir, tmp_path, monkeypatch):
    """Found by the UX pass: --json's `options` kept a run or data folder as the relative path typed, meaningless once
    the report is shared (as the manifests' records already were absolute)."""
    monkeypatch.chdir(dpo_data.parent)
    code, report, output = audit(dpo_cache, "--data", dpo_data.name, "--model", llama_dir, "--sample", 0,
                                 json_path=tmp_path / "audit.json")
    assert report is not None, output
    assert report["options"]["data"] == str(dpo_data.absolute()) and report["options"]["run"] is None


def test_a_mistyped_cache_reads_like_the_other_location_refusals(cache, tmp_path, monkeypatch):
    """Issue 36: `audit-ref c33` put its "did you mean" inside click's "Invalid value for 'CACHE': ..."; it reads as
    train-dpo's `--ref-cache c33: does not exist; did you mean c3?` does, exit 2; a click-checked option that is
    not there is named as typed the same way."""
    import shutil

    from click.testing import CliRunner

    from audit.cli import main

    shutil.copytree(cache, tmp_path / "here" / "c3")
    monkeypatch.chdir(tmp_path / "here")
    result = CliRunner().invoke(main, ["c33"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "Error: CACHE c33: does not exist; did you mean c3? (the current folder holds: c3/)" in said, said
    assert "Invalid value" not in said, said
    result = CliRunner().invoke(main, ["c3", "--run", "rn1"])
    assert result.exit_code == 2 and "Error: --run rn1: does not exist" in " ".join(result.output.split()), \
        result.output
