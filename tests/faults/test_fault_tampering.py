"""Tampering matrix: one case per way a cache, a checkpoint, a tokenizer or the data can differ from what the cache
was made with. For each, train-dpo refuses before training with that cause's own message (exit 2), and audit-ref
fails the check that owns the cause (exit 1), or refuses an unreadable cache (exit 2).

Forgeries that rewrite a shard also rewrite its manifest entry (size, sha256) the way someone who read FORMAT.md
would, so that the check behind the file hash has to catch them. Everything runs in process (click's CliRunner) on a
copy of the session's 40-row, three-shard cache (`dpo_cache`: shards of 16, 16 and 8 rows).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import CHAT_TEMPLATE, DPO_PAIRS, pref_rows, write_jsonl
from faultkit import (TRAIN, assert_one_paragraph, audit, check_of, copy_tree, edit_manifest, failed_checks,
                      manifest_of, restamp, rewrite_rows, set_metadata, train)
from schemas import format as fmt
from schemas.stamps import model_hash

S0, S1, S2 = (f"shard-{i:05d}.parquet" for i in range(3))


def change_one_weight(model_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[-1]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[5] += torch.tensor(1e-3, dtype=tensors[name].dtype)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def world(tmp_path_factory, llama_dir, dpo_data, dpo_cache) -> dict:
    """Everything the cases need, each differing from the cached setup in one respect."""
    from transformers import AutoTokenizer

    from precompute.job import PrecomputeConfig, run_precompute

    base = tmp_path_factory.mktemp("tampering")
    w = {"llama": llama_dir, "data": dpo_data, "cache": dpo_cache, "base": base}

    w["other_cache"] = base / "other-cache"  # same model and ids, other texts
    run_precompute(PrecomputeConfig(model=str(llama_dir), rows_per_shard=16, progress=False, out=str(w["other_cache"]),
                                    data=str(write_jsonl(base / "other.jsonl", pref_rows(DPO_PAIRS, seed=5,
                                                                                         fmt="conversational")))),
                   log=lambda m: None)

    w["added_token"] = copy_tree(llama_dir, base / "added-token")
    tok = AutoTokenizer.from_pretrained(w["added_token"])
    assert tok.add_tokens(["<extra>"]) == 1
    tok.save_pretrained(w["added_token"])

    w["template"] = copy_tree(llama_dir, base / "template")
    (w["template"] / "chat_template.jinja").write_text(CHAT_TEMPLATE.replace("</s>\n", "</s>"))

    w["weight"] = copy_tree(llama_dir, base / "weight")
    change_one_weight(w["weight"])

    w["rope"] = copy_tree(llama_dir, base / "rope")
    config = json.loads((w["rope"] / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 20000.0
    (w["rope"] / "config.json").write_text(json.dumps(config, indent=2))

    for name in ("added_token", "template", "weight", "rope"):
        changed = model_hash(w[name]) != model_hash(llama_dir)
        assert changed == (name in ("weight", "rope")), name  # tokenizer edits leave the model hash alone

    rows = pref_rows(DPO_PAIRS, fmt="conversational")
    rows[7]["chosen"][0]["content"] += " edited"
    w["edited_data"] = write_jsonl(base / "edited" / "prefs.jsonl", rows)
    w["more_data"] = write_jsonl(base / "more" / "prefs.jsonl", pref_rows(DPO_PAIRS + 2, fmt="conversational"))
    return w


# ---------------------------------------------------------------------------------------------------------------
# the tampering: each edits `cache` (a fresh copy) and/or returns what train-dpo and audit-ref are run with


def flip_byte(w, cache):
    path = cache / S1
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate_shard(w, cache):
    path = cache / S1
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def delete_shard(w, cache):
    (cache / S2).unlink()


def extra_unlisted_shard(w, cache):
    shutil.copy(cache / S0, cache / "shard-00003.parquet")


def shard_from_other_cache(w, cache):
    """Copied in from a cache of other data (same model and tokenizer) and restamped in the manifest."""
    shutil.copy(w["other_cache"] / S1, cache / S1)
    restamp(cache, S1)


def shard_from_other_cache_unstamped(w, cache):
    shutil.copy(w["other_cache"] / S1, cache / S1)
    assert (cache / S1).stat().st_size != (w["cache"] / S1).stat().st_size  # so the size check is the one to fire


def rows_reordered(w, cache):
    rewrite_rows(cache, S0, lambda rows: [rows[1], rows[0], *rows[2:]])
    restamp(cache, S0)


def row_moved_between_shards(w, cache):
    """Row 0 of shard 0 moved to the end of shard 1, with both shards' checksums (mask and ids), metadata, row counts
    and file hashes rewritten to match: only the whole-cache checksum (row order across shards) is left to notice."""
    moved = {}

    def take(rows):
        moved["row"] = rows[0]
        return rows[1:]

    from schemas.stamps import ids_checksum

    def shard_checksum(rows):
        from schemas.stamps import combined_mask_checksum

        enc = fmt.EncodingConfig.from_dict(manifest_of(cache)["encoding"]).to_json()
        return combined_mask_checksum([r["mask_checksum"] for r in rows], enc).encode()

    for name, edit in ((S0, take), (S1, lambda rows: [*rows, moved["row"]])):
        new = {}
        rewrite_rows(cache, name, lambda rows: new.setdefault("rows", edit(rows)),
                     metadata_edit=lambda meta: meta.update({
                         b"refcache.mask_checksum": shard_checksum(new["rows"]),
                         b"refcache.ids_checksum": ids_checksum([r["id"] for r in new["rows"]]).encode()}))
    restamp(cache, S0, S1, rows=True, checksums=True)


def logprob_edited(w, cache):
    """One per-token log-prob changed; the file hash and manifest entry rewritten to match."""
    rewrite_rows(cache, S0, lambda rows: rows[2]["chosen_logps"].__setitem__(0, rows[2]["chosen_logps"][0] - 0.5))
    restamp(cache, S0)


def manifest_stamp(stamp):
    def edit(w, cache):
        edit_manifest(cache, lambda m: m["stamps"].__setitem__(stamp, "0" * 64))
    edit.__name__ = f"manifest_{stamp}_edited"
    return edit


def shard_metadata_stamp(stamp):
    def edit(w, cache):
        set_metadata(cache, S1, stamp, "0" * 64)
        restamp(cache, S1)
    edit.__name__ = f"shard_metadata_{stamp}_edited"
    return edit


def malformed_manifest(w, cache):
    path = cache / fmt.MANIFEST
    path.write_text(path.read_text()[:-40])


def future_format_version(w, cache):
    edit_manifest(cache, lambda m: m.update(format_version=2, software={"refcache": "99.0"}))  # a newer refcache's


def shard_name_climbs_out(w, cache):
    outside = cache.parent / "outside"
    outside.mkdir()
    shutil.copy(cache / S0, outside / S0)
    edit_manifest(cache, lambda m: m["shards"][0].__setitem__("file", f"../outside/{S0}"))


def symlink_leaves_directory(w, cache):
    outside = cache.parent / "outside.parquet"
    shutil.move(cache / S1, outside)
    (cache / S1).symlink_to(outside)


def manifest_encoding_edited(w, cache):
    edit_manifest(cache, lambda m: m["encoding"].__setitem__("max_length", 64))


def tokenizer_added_token(w, cache):
    return {"--model": w["added_token"]}, ["--model", w["added_token"], "--sample", 0]


def chat_template_changed(w, cache):
    return {"--model": w["template"]}, ["--model", w["template"], "--sample", 0]


def max_length_changed(w, cache):
    return ["--max-length", 64], None


def truncation_mode_changed(w, cache):
    return ["--truncation-mode", "keep_end"], None


def policy_weight_changed(w, cache):
    return {"--model": w["weight"]}, ["--model", w["weight"]]


def config_rope_theta_changed(w, cache):
    return {"--model": w["rope"]}, ["--model", w["rope"]]


def data_edited_after_precompute(w, cache):
    return {"--data": w["edited_data"]}, ["--model", w["llama"], "--sample", 0, "--data", w["edited_data"]]


def data_rows_added_after_precompute(w, cache):
    return {"--data": w["more_data"]}, ["--model", w["llama"], "--sample", 0, "--data", w["more_data"]]


def hashes(w, name):
    return model_hash(w[name])


# (tampering, train-dpo message parts, audit-ref outcome: (failing checks, (shard, row) of the first failure or None
#  [, checks that may also fail]), or ("exit 2", message part), or None where audit-ref takes no such input).
# "May also fail": audit-ref reports a foreign or re-encoded shard under shard_stamps and again under shard_checksums
# (its rows' checksums, computed with the manifest's encoding, do not add up either); see the report to the lead.
CASES = [
    (flip_byte, lambda w: [f"shard {S1} content differs from the manifest (file sha256)"],
     ({"shard_files"}, (S1, None))),
    (truncate_shard, lambda w: [f"shard {S1} has the wrong size", "expected: ", "found:    "],
     ({"shard_files"}, (S1, None))),
    (delete_shard, lambda w: [f"shard {S2} listed in the manifest is missing"], ({"shard_files"}, (S2, None))),
    (extra_unlisted_shard, lambda w: ["holds shard files the manifest does not list: shard-00003.parquet"],
     ({"shard_files"}, ("shard-00003.parquet", None))),
    (shard_from_other_cache, lambda w: [f"shard {S1}: metadata 'refcache.mask_checksum' differs from the manifest"],
     ({"shard_stamps"}, (S1, None), {"shard_checksums"})),
    (shard_from_other_cache_unstamped, lambda w: [f"shard {S1} has the wrong size"], ({"shard_files"}, (S1, None))),
    (rows_reordered, lambda w: [f"shard {S0}: its rows' mask checksums do not add up to the shard's (rows edited, "
                                "reordered or moved)"], ({"shard_checksums"}, (S0, None))),
    (row_moved_between_shards, lambda w: ["the shards' rows do not add up to the manifest's mask checksum (rows moved "
                                          "between shards?)"], ({"cache_checksum"}, None)),
    (logprob_edited, lambda w: ["cached log-probs of row 'r0002' are inconsistent", f"where:    shard {S0}, row 2"],
     ({"sums"}, (S0, 2))),
    (manifest_stamp("model_hash"), lambda w: [f"shard {S0}: metadata 'refcache.model_hash' differs from the manifest"],
     ({"shard_stamps"}, (S0, None))),
    (manifest_stamp("tokenizer_hash"),
     lambda w: [f"shard {S0}: metadata 'refcache.tokenizer_hash' differs from the manifest"],
     ({"shard_stamps"}, (S0, None))),
    (manifest_stamp("mask_checksum"), lambda w: ["the shards' rows do not add up to the manifest's mask checksum"],
     ({"cache_checksum"}, None)),
    (shard_metadata_stamp("model_hash"),
     lambda w: [f"shard {S1}: metadata 'refcache.model_hash' differs from the manifest", "found:    " + "0" * 64],
     ({"shard_stamps"}, (S1, None))),
    (shard_metadata_stamp("tokenizer_hash"),
     lambda w: [f"shard {S1}: metadata 'refcache.tokenizer_hash' differs from the manifest"],
     ({"shard_stamps"}, (S1, None))),
    (malformed_manifest, lambda w: ["manifest.json is not valid JSON"], ("exit 2", "is not valid JSON")),
    (future_format_version, lambda w: ["has format version 2; this refcache reads version 1", "remedy:   upgrade refcache"],
     ("exit 2", "has format version 2")),
    (shard_name_climbs_out, lambda w: [f"manifest names shard '../outside/{S0}', which is not a plain .parquet file "
                                       "name inside the cache"], ({"shard_files"}, (f"../outside/{S0}", None))),
    (symlink_leaves_directory, lambda w: [f"shard {S1} is a symlink leaving the cache directory"],
     ({"shard_files"}, (S1, None))),
    (manifest_encoding_edited, lambda w: [f"shard {S0}: metadata 'refcache.encoding' differs from the manifest"],
     ({"shard_stamps"}, (S0, None), {"shard_checksums"})),
    (tokenizer_added_token, lambda w: ["tokenizer_hash mismatch", "not computed with this tokenizer"],
     ({"tokenizer_hash"}, None)),
    (chat_template_changed, lambda w: ["tokenizer_hash mismatch", "including its chat template"],
     ({"tokenizer_hash"}, None)),
    (max_length_changed, lambda w: ["--max-length 64 conflicts with the cache", "made with --max-length 1024"], None),
    (truncation_mode_changed, lambda w: ["--truncation-mode keep_end conflicts with the cache",
                                         "made with --truncation-mode keep_start"], None),
    (policy_weight_changed, lambda w: ["model_hash mismatch", "not computed with this model",
                                       "this run:  " + hashes(w, "weight")], ({"model_hash"}, None)),
    (config_rope_theta_changed, lambda w: ["model_hash mismatch", "this run:  " + hashes(w, "rope")],
     ({"model_hash"}, None)),
    (data_edited_after_precompute, lambda w: ["mask checksum mismatch for row 'r0007'", f"where:    shard {S0}, row 7"],
     ({"data_rows"}, (S0, 7))),
    (data_rows_added_after_precompute, lambda w: ["2 of 42 data rows are not in the cache", "first ids: 'r0040', 'r0041'", "--update"],
     ({"data_rows"}, None)),
]
IDS = [c[0].__name__ for c in CASES]


@pytest.fixture()
def case_cache(world, tmp_path) -> Path:
    return copy_tree(world["cache"], tmp_path / "cache")


def apply(case, world, cache):
    given = case(world, cache) or ({}, [])
    train_extra, audit_args = given
    replace = train_extra if isinstance(train_extra, dict) else {}
    extra = [] if isinstance(train_extra, dict) else train_extra
    return replace, extra, audit_args


@pytest.mark.parametrize("case,expected,_", CASES, ids=IDS)
def test_train_dpo_refuses_with_its_own_message(world, case_cache, tmp_path, case, expected, _):
    replace, extra, _ = apply(case, world, case_cache)
    args = {"--model": world["llama"], "--data": world["data"], "--ref-cache": case_cache,
            "--output-dir": tmp_path / "out", **replace}
    result = train(*[a for kv in args.items() for a in kv], *extra, *TRAIN)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") or "\nerror: " in result.output, result.output
    for text in expected(world):
        assert text in result.output, f"{text!r} not in\n{result.output}"
    assert "remedy:" in result.output
    assert_one_paragraph(result.output)
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize("case,_,outcome", [c for c in CASES if c[2] is not None],
                         ids=[i for i, c in zip(IDS, CASES) if c[2] is not None])
def test_audit_ref_fails_the_check_that_owns_it(world, case_cache, case, _, outcome):
    *_, audit_args = apply(case, world, case_cache)
    code, report, output = audit(case_cache, *(audit_args or []))
    if outcome[0] == "exit 2":
        assert code == 2 and report is None, output
        assert "error:" in output and outcome[1] in output and "Traceback" not in output
        return
    failing, where, also = (*outcome, set())[:3]
    assert code == 1, output
    assert failing <= failed_checks(report) <= failing | also, output
    assert report["failed"][0] in failing  # the owner is the first failure reported
    first = check_of(report, report["failed"][0])
    if where:
        assert (first["shard"], first["row"]) == where, first
    assert output.rstrip().splitlines()[-1].startswith("FAIL: ")


def test_clean_cache_passes_both(world, case_cache, tmp_path):
    """The baseline the matrix departs from: the untouched copy verifies and audits clean."""
    from dpo.verify import verify_and_join
    from runtime.checkpoint import load_tokenizer

    verified = verify_and_join(tokenizer=load_tokenizer(str(world["llama"])), model_dir=str(world["llama"]),
                               data=str(world["data"]), split="train", cache_dir=case_cache, log=lambda m: None)
    assert verified.table.num_rows == DPO_PAIRS
    code, report, output = audit(case_cache, "--model", world["llama"], "--data", world["data"], "--sample", 0)
    assert code == 0 and not failed_checks(report), output


def test_consistent_value_forgery_passes_train_dpo_and_fails_the_audit_replay(world, case_cache):
    """A log-prob edited together with its sum, file hash and manifest is internally consistent: train-dpo, which
    never runs the reference, cannot see it (documented limit); audit-ref's replay of the reference does."""
    from dpo.verify import verify_and_join
    from runtime.checkpoint import load_tokenizer

    def edit(rows):
        rows[2]["chosen_logps"][0] -= 0.5
        rows[2]["chosen_logp"] -= 0.5

    rewrite_rows(case_cache, S0, edit)
    restamp(case_cache, S0)
    verify_and_join(tokenizer=load_tokenizer(str(world["llama"])), model_dir=str(world["llama"]),
                    data=str(world["data"]), split="train", cache_dir=case_cache, log=lambda m: None)
    code, report, output = audit(case_cache, "--model", world["llama"], "--all")
    assert code == 1 and failed_checks(report) == {"replay"}, output
    replay = check_of(report, "replay")
    assert (replay["shard"], replay["row"]) == (S0, 2) and "chosen token 0" in replay["detail"]


# ---------------------------------------------------------------------------------------------------------------
# audit-ref on damage that only its own readers meet (bugs this suite found in audit.py, now fixed).


def test_audit_survives_metadata_that_is_not_utf8(world, case_cache):
    """A metadata key outside refcache's own (ignored by the format) that is not UTF-8, manifest restamped: train-dpo
    reads the cache; audit-ref must finish its report."""
    rewrite_rows(case_cache, S0, lambda rows: rows, metadata_edit=lambda meta: meta.__setitem__(b"\xcc\x01", b"x"))
    restamp(case_cache, S0)
    from dpo.verify import verify_and_join
    from runtime.checkpoint import load_tokenizer

    verify_and_join(tokenizer=load_tokenizer(str(world["llama"])), model_dir=str(world["llama"]),
                    data=str(world["data"]), split="train", cache_dir=case_cache, log=lambda m: None)
    code, report, output = audit(case_cache)
    assert code in (0, 1) and report is not None, output


def test_audit_reports_a_shard_whose_footer_names_are_not_utf8(world, case_cache, tmp_path):
    """One byte of a column name in the shard's footer made invalid UTF-8, manifest restamped: train-dpo refuses the
    shard as unreadable; audit-ref must fail shard_files."""
    path = case_cache / S0
    data = bytearray(path.read_bytes())
    data[data.index(b"prompt_input_ids") + 3] = 0xFF
    path.write_bytes(bytes(data))
    restamp(case_cache, S0)
    result = train("--model", world["llama"], "--data", world["data"], "--ref-cache", case_cache,
                   "--output-dir", tmp_path / "out", *TRAIN)
    assert result.exit_code == 2 and f"shard {S0} is not a readable Parquet file" in result.output, result.output
    code, report, output = audit(case_cache)
    assert code == 1 and failed_checks(report) == {"shard_files"}, output
