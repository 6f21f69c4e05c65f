"""precompute-ref in process (click's CliRunner): numbers against a plain forward, formats and containers, resume,
refusals, bad input, RNG hygiene and --help. Real subprocesses (exit codes, kill -9, a second process) live in
test_precompute_cli.py."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import hashlib
import json
import math
import random
import re
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from conftest import build_llama, pref_rows, save_checkpoint, write_jsonl
from precompute.cli import main
from schemas import format as fmt

# ---------------------------------------------------------------------------------------------------------------
# helpers


def cli(*args):
    """Run precompute-ref in process; returns click's Result (exit_code, output = stdout and stderr)."""
    return CliRunner().invoke(main, [str(a) for a in args] + ["--no-progress"], catch_exceptions=False)


def ok(*args):
    result = cli(*args)
    assert result.exit_code == 0, result.output
    return result


def manifest_of(out: Path) -> dict:
    return json.loads((out / fmt.MANIFEST).read_text())


def shard_hashes(out: Path) -> dict[str, str]:
    """sha256 of every shard file in the directory (listed or not)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.parquet"))}


def dir_state(out: Path) -> dict[str, str]:
    """Every file in the directory with its content hash."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir()) if p.is_file()}


def read_cache(out: Path) -> pl.DataFrame:
    """All rows, read straight from the shard files in manifest order (no refcache reader involved)."""
    return pl.concat([pl.read_parquet(out / s["file"]) for s in manifest_of(out)["shards"]])


def scored_now(result) -> tuple[int, int]:
    m = re.search(r"wrote (\d+) pairs \((\d+) scored now\)", result.output)
    assert m, result.output
    return int(m.group(1)), int(m.group(2))


def assert_not_valid(out: Path):
    """Nothing in `out` reads as a usable cache."""
    assert not (out / fmt.MANIFEST).exists()
    with pytest.raises(fmt.CacheError):
        fmt.open_cache(out)


@pytest.fixture(scope="session")
def llama_other_dir(tmp_path_factory, tokenizer) -> Path:
    """Same architecture and tokenizer as llama_dir, different weights: only the model hash differs."""
    return save_checkpoint(build_llama(len(tokenizer), seed=1), tokenizer, tmp_path_factory.mktemp("llama-other"))


# ---------------------------------------------------------------------------------------------------------------
# 1. the cached numbers equal an independent plain forward


@pytest.mark.parametrize(
    "model_fixture, data_format, max_length",
    [("llama_dir", "conversational", 1024), ("gpt2_dir", "standard", 48)],  # gpt2: char-level, completions truncated
)
def test_cached_logps_equal_plain_transformers_forward(request, tmp_path, model_fixture, data_format, max_length):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = request.getfixturevalue(model_fixture)
    rows = pref_rows(20, seed=3, fmt=data_format)
    data = write_jsonl(tmp_path / "prefs.jsonl", rows)
    out = tmp_path / "cache"
    # Small shards and a small token budget: several length-sorted, right-padded batches in every shard.
    result = ok("--model", model_dir, "--data", data, "--out", out, "--rows-per-shard", 6, "--token-budget", 150,
                "--max-length", max_length)
    assert float(re.search(r"padding: ([\d.]+)%", result.output).group(1)) > 0  # the padded path was exercised
    manifest = manifest_of(out)
    assert [s["rows"] for s in manifest["shards"]] == [6, 6, 6, 2]
    comp = manifest["computation"]
    assert comp["dtype"] == "float32" and comp["device_type"] == "cpu"
    assert comp["mode"] in ("full_forward", "kv_cache", "packed", "shared_prompt", "single")  # never "auto"
    assert comp["head"] == "hook"  # plain projection heads: verified against the model's own logits
    assert comp["attn_implementation"] == "sdpa"  # what transformers picks for these models, actually loaded

    schema = pq.read_schema(out / manifest["shards"][0]["file"])
    assert schema.field("chosen_logps").type == pa.list_(pa.float32())
    assert schema.field("chosen_logp").type == pa.float64()
    df = read_cache(out)
    assert df["id"].to_list() == [r["id"] for r in rows]  # input order, whatever the batching order

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bos, eos = tok.bos_token_id, tok.eos_token_id
    plain = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    truncated = 0
    for row, rec in zip(rows, df.iter_rows(named=True)):
        prompt = rec["prompt_input_ids"]
        # The ids belong to this row (checked against the tokenizer directly, not through the encoder).
        # BOS as the tokenizer and the template give it: this tokenizer adds none, the template renders none
        if data_format == "standard":
            assert prompt == tok(row["prompt"])["input_ids"] == plain(row["prompt"])
        else:
            assert tok.decode(prompt) == f"<|user|>\n{row['prompt'][0]['content']}</s>\n<|assistant|>\n"
        for side in ("chosen", "rejected"):
            comp = rec[f"{side}_input_ids"]
            if data_format == "standard":
                full = plain(row[side]) + [eos]
                assert comp == full[: max_length - len(prompt)]
                truncated += len(comp) < len(full)
            else:
                assert tok.decode(comp) == row[side][0]["content"] + "</s>"
            logps = np.asarray(rec[f"{side}_logps"], dtype=np.float32)
            assert len(logps) == len(comp) > 0
            with torch.no_grad():  # one unpadded row, full log-softmax
                lp = model(torch.tensor([prompt + comp])).logits.float().log_softmax(-1)[0]
            p = len(prompt)
            expected = lp[torch.arange(p - 1, p - 1 + len(comp)), torch.tensor(comp)].numpy()
            np.testing.assert_allclose(logps, expected, rtol=0, atol=1e-5)
            assert np.all(logps < 0)
            total = math.fsum(float(x) for x in logps)  # float64 sum of the stored float32 values
            assert rec[f"{side}_logp"] == pytest.approx(total, rel=1e-12, abs=1e-9)
    if data_format == "standard":
        assert truncated > 0  # keep_start truncation happened and was scored over the kept tokens only


# ---------------------------------------------------------------------------------------------------------------
# 2. data formats, input containers and row ids


def write_container(kind: str, rows: list[dict], base: Path) -> tuple[Path, list[str]]:
    """Write `rows` in one container; returns (--data path, extra CLI args)."""
    import datasets

    base.mkdir(parents=True, exist_ok=True)
    decoys = pref_rows(5, seed=99, fmt="standard" if isinstance(rows[0].get("chosen"), str) else "conversational")
    if kind == "jsonl":
        return write_jsonl(base / "prefs.jsonl", rows), []
    if kind == "json":  # one JSON array
        (base / "prefs.json").write_text(json.dumps(rows, indent=1))
        return base / "prefs.json", []
    if kind == "json_lines_in_json":
        return write_jsonl(base / "prefs.json", rows), []
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), base / "prefs.parquet")
        return base / "prefs.parquet", []
    if kind == "csv":
        with open(base / "prefs.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        return base / "prefs.csv", []
    if kind == "dir":  # two train files, read in name order, and a file of another split that must be ignored
        d = base / "prefs"
        half = len(rows) // 2
        write_jsonl(d / "train-00000-of-00002.jsonl", rows[:half])
        write_jsonl(d / "train-00001-of-00002.jsonl", rows[half:])
        write_jsonl(d / "test.jsonl", decoys)
        return d, []
    if kind == "saved_dataset":
        datasets.Dataset.from_list(rows).save_to_disk(str(base / "saved"))
        return base / "saved", []
    if kind == "saved_dict":
        datasets.DatasetDict(
            {"train": datasets.Dataset.from_list(decoys), "eval": datasets.Dataset.from_list(rows)}
        ).save_to_disk(str(base / "saved"))
        return base / "saved", ["--split", "eval"]
    raise AssertionError(kind)


CONTAINERS = ["json", "json_lines_in_json", "parquet", "dir", "saved_dataset", "saved_dict"]
FORMATS = ["standard", "conversational", "implicit"]


def format_rows(data_format: str) -> list[dict]:
    rows = pref_rows(12, seed=5, fmt=data_format)
    if data_format == "standard":  # text that needs CSV quoting
        rows[3]["prompt"] = 'is the sky "blue", or green?\nyes, one line more'
    return rows


@pytest.fixture(scope="module")
def reference_caches(llama_dir, tmp_path_factory):
    """One .jsonl run per data format, the reference every other container must reproduce byte for byte."""
    made = {}

    def get(data_format):
        if data_format not in made:
            base = tmp_path_factory.mktemp(f"ref-{data_format}")
            data, _ = write_container("jsonl", format_rows(data_format), base)
            ok("--model", llama_dir, "--data", data, "--out", base / "cache", "--rows-per-shard", 5)
            made[data_format] = base / "cache"
        return made[data_format]

    return get


@pytest.mark.parametrize("data_format", FORMATS)
def test_jsonl_reference_per_format(reference_caches, data_format, tokenizer):
    out = reference_caches(data_format)
    rows = format_rows(data_format)
    df = read_cache(out)
    assert df["id"].to_list() == [r["id"] for r in rows]
    manifest = manifest_of(out)
    assert manifest["rows"] == 12 and manifest["source"]["rows_in"] == 12
    assert [s["rows"] for s in manifest["shards"]] == [5, 5, 2]
    fmt.open_cache(out)  # the project's own verifier accepts it
    first = df.row(0, named=True)
    text = tokenizer.decode(first["prompt_input_ids"] + first["chosen_input_ids"])
    if data_format == "conversational":  # the chat template was applied
        assert text.startswith("<|user|>\n") and "<|assistant|>\n" in text  # the template renders no BOS
    else:
        assert "<|user|>" not in text
    if data_format == "implicit":  # prompt = common prefix, completions start at the word where they differ
        assert tokenizer.decode(first["chosen_input_ids"]) == " sure" + rows[0]["chosen"].split(" sure", 1)[1] + "</s>"


@pytest.mark.parametrize(
    "data_format, container",
    [(f, c) for f in FORMATS for c in CONTAINERS] + [("standard", "csv")],
)
def test_every_container_gives_the_same_cache(llama_dir, reference_caches, tmp_path, data_format, container):
    rows = format_rows(data_format)
    data, extra = write_container(container, rows, tmp_path)
    out = tmp_path / "cache"
    ok("--model", llama_dir, "--data", data, "--out", out, "--rows-per-shard", 5, *extra)
    reference = reference_caches(data_format)
    assert read_cache(out)["id"].to_list() == [r["id"] for r in rows]
    # Same ids, same tokens, same numbers, same stamps: the shard files are byte-identical to the .jsonl run's.
    assert shard_hashes(out) == shard_hashes(reference)
    manifest, ref_manifest = manifest_of(out), manifest_of(reference)
    assert manifest["stamps"] == ref_manifest["stamps"]
    assert manifest["source"]["rows_in"] == 12
    if container == "dir":
        assert [Path(f).name for f in manifest["source"]["files"]] == [
            "train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl"]
    fmt.open_cache(out)


def test_ids_without_an_id_column_are_stable_content_hashes(llama_dir, tmp_path):
    rows = [{k: v for k, v in r.items() if k != "id"} for r in pref_rows(10, seed=7)]
    a = write_jsonl(tmp_path / "a.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet")
    ok("--model", llama_dir, "--data", a, "--out", tmp_path / "run1")
    ok("--model", llama_dir, "--data", a, "--out", tmp_path / "run2")
    ok("--model", llama_dir, "--data", tmp_path / "b.parquet", "--out", tmp_path / "run3")
    ids = read_cache(tmp_path / "run1")["id"].to_list()
    assert len(set(ids)) == len(rows)
    assert all(re.fullmatch(r"sha256:[0-9a-f]{32}", i) for i in ids)
    assert read_cache(tmp_path / "run2")["id"].to_list() == ids  # same id across runs
    assert read_cache(tmp_path / "run3")["id"].to_list() == ids  # and across containers
    # The id follows the content: editing one row changes its id only; reordering rows moves the ids with them.
    edited = [dict(r) for r in rows]
    edited[4]["chosen"] += " yes"
    edited = edited[::-1]
    write_jsonl(tmp_path / "c.jsonl", edited)
    ok("--model", llama_dir, "--data", tmp_path / "c.jsonl", "--out", tmp_path / "run4")
    ids4 = read_cache(tmp_path / "run4")["id"].to_list()[::-1]
    assert [i for n, i in enumerate(ids4) if n != 4] == [i for n, i in enumerate(ids) if n != 4]
    assert ids4[4] != ids[4]


# ---------------------------------------------------------------------------------------------------------------
# 3. determinism and resume (the kill -9 test is in test_precompute_cli.py)


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
    assert sorted(p.name for p in out.iterdir()) == sorted([*clean, fmt.MANIFEST, fmt.LOCK])  # no temp files left
    fmt.open_cache(out)
    assert scored_now(ok(*args, "--out", out)) == (30, 0)  # finished: nothing to redo


# ---------------------------------------------------------------------------------------------------------------
# 4. refusals


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
    cache = fmt.open_cache(out)
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
    fmt.open_cache(out)
    assert scored_now(ok(*args)) == (12, 0)  # once the lock is free, the same job resumes (nothing to do)


# ---------------------------------------------------------------------------------------------------------------
# 5. bad input


LONG_PROMPT = " ".join(["question"] * 50) + "?"
BAD_ROWS = {  # case -> (JSON Lines line, reason key)
    "missing_field": ('{"id": "bad-missing", "prompt": "why?", "chosen": "sure yes"}', "missing_field"),
    "mistyped": ('{"id": "bad-int", "prompt": "why?", "chosen": 5, "rejected": "hmm no"}', "bad_type"),
    "empty_completion": ('{"id": "bad-empty", "prompt": "why?", "chosen": "", "rejected": "hmm no"}', "empty_field"),
    "blank_completion": ('{"id": "bad-blank", "prompt": "why?", "chosen": "sure", "rejected": "  "}', "empty_field"),
    "unparsable_json": ('{"id": "bad-json", "prompt": "why?", "chosen": "sure"', "bad_json"),
    "non_text_list": ('{"id": "bad-list", "prompt": "why?", "chosen": "sure", "rejected": [1, 2]}', "bad_message"),
    "non_text_bool": ('{"id": "bad-bool", "prompt": true, "chosen": "sure", "rejected": "hmm"}', "bad_type"),
    "prompt_too_long": (json.dumps({"id": "bad-long", "prompt": LONG_PROMPT, "chosen": "sure", "rejected": "hmm"}),
                        "prompt_too_long"),
    "duplicate_id": ('{"id": "r0001", "prompt": "why?", "chosen": "sure yes", "rejected": "hmm no"}', "duplicate_id"),
}
GOOD = [json.dumps(r) for r in pref_rows(6, seed=17)]  # ids r0000..r0005; all fit in --max-length 40


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_row_stops_the_run_naming_file_row_and_reason(llama_dir, tmp_path, case):
    line, reason = BAD_ROWS[case]
    # The bad row is on line 5: a blank line 2 must not shift the row number.
    data = tmp_path / "prefs.jsonl"
    data.write_text("\n".join([GOOD[0], "", GOOD[1], GOOD[2], line, *GOOD[3:]]) + "\n")
    out = tmp_path / "cache"
    result = cli("--model", llama_dir, "--data", data, "--out", out, "--max-length", 40)
    assert result.exit_code == 2, result.output
    assert f"error: {data}, row 5: {reason}" in result.output
    assert_not_valid(out)


def test_missing_column_names_the_column(llama_dir, tmp_path):
    rows = [{"id": r["id"], "prompt": r["prompt"], "chosen": r["chosen"], "rejectd": r["rejected"]}
            for r in pref_rows(5)]
    data = write_jsonl(tmp_path / "prefs.jsonl", rows)
    result = cli("--model", llama_dir, "--data", data, "--out", tmp_path / "cache")
    assert result.exit_code == 2
    assert f"{data}, row 1: missing_field: row has no 'rejected'" in result.output and "rejectd" in result.output
    assert not (tmp_path / "cache" / fmt.MANIFEST).exists()


def test_skip_bad_rows_lists_and_counts_them(llama_dir, tmp_path):
    identical = json.dumps({"id": "same", "prompt": "why?", "chosen": "sure yes", "rejected": "sure yes"})
    d = tmp_path / "prefs"
    d.mkdir()
    a, b = d / "train-a.jsonl", d / "train-b.jsonl"
    # File a loads through `datasets`; file b holds an unparsable line and is read line by line.
    lines_a = [GOOD[0], "", GOOD[1]] + [BAD_ROWS[c][0] for c in (
        "missing_field", "mistyped", "empty_completion", "blank_completion", "non_text_list", "non_text_bool",
        "prompt_too_long")] + [identical, GOOD[2]]
    lines_b = [GOOD[3], BAD_ROWS["unparsable_json"][0], BAD_ROWS["duplicate_id"][0], GOOD[4], "", GOOD[5]]
    a.write_text("\n".join(lines_a) + "\n")
    b.write_text("\n".join(lines_b) + "\n")
    out = tmp_path / "cache"
    result = ok("--model", llama_dir, "--data", d, "--out", out, "--max-length", 40, "--on-bad-row", "skip")
    assert "skipped 9 bad rows" in result.output
    assert "warning: 1 pairs have identical chosen and rejected completions" in result.output

    expected = [
        (str(a), 4, "bad-missing", "missing_field"), (str(a), 5, "bad-int", "bad_type"),
        (str(a), 6, "bad-empty", "empty_field"), (str(a), 7, "bad-blank", "empty_field"),
        (str(a), 8, "bad-list", "bad_message"), (str(a), 9, "bad-bool", "bad_type"),
        (str(a), 10, "bad-long", "prompt_too_long"),
        (str(b), 2, None, "bad_json"), (str(b), 3, "r0001", "duplicate_id"),
    ]
    listed = [json.loads(line) for line in (out / fmt.SKIPPED).read_text().splitlines()]
    assert [(s["file"], s["row"], s["id"], s["reason"]) for s in listed] == expected
    assert all(s["detail"] for s in listed)
    source = manifest_of(out)["source"]
    assert source["skipped_by_reason"] == {"bad_json": 1, "bad_message": 1, "bad_type": 2, "duplicate_id": 1,
                                           "empty_field": 2, "missing_field": 1, "prompt_too_long": 1}
    assert source["skipped"] == 9 and source["identical_pairs"] == 1 and source["rows_in"] == 16
    cache = fmt.open_cache(out)
    ids = cache.read(["id"]).column("id").to_pylist()
    assert ids == ["r0000", "r0001", "same", "r0002", "r0003", "r0004", "r0005"]
    same = read_cache(out).filter(pl.col("id") == "same").row(0, named=True)
    np.testing.assert_allclose(same["chosen_logps"], same["rejected_logps"], rtol=0, atol=1e-6)

    # A rerun without bad rows removes the stale skipped.jsonl.
    clean = write_jsonl(tmp_path / "clean.jsonl", [json.loads(g) for g in GOOD])
    ok("--model", llama_dir, "--data", clean, "--out", out, "--max-length", 40, "--overwrite")
    assert not (out / fmt.SKIPPED).exists() and manifest_of(out)["source"]["skipped_by_reason"] == {}


def test_pickle_only_checkpoint_is_refused(llama_dir, tmp_path):
    model = tmp_path / "pickled"
    model.mkdir()
    for f in llama_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, model)
    torch.save({"lm_head.weight": torch.zeros(2, 2)}, model / "pytorch_model.bin")
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(4))
    result = cli("--model", model, "--data", data, "--out", tmp_path / "cache")
    assert result.exit_code == 2, result.output
    assert "pytorch_model.bin" in result.output and "safetensors only" in result.output
    assert not (tmp_path / "cache").exists()


def test_remote_code_checkpoint_needs_trust_remote_code(llama_dir, tmp_path):
    model = tmp_path / "custom"
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    ran = tmp_path / "custom-code-ran"
    (model / "modeling_custom.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(4))
    result = cli("--model", model, "--data", data, "--out", tmp_path / "cache")
    assert result.exit_code == 2, result.output
    assert "auto_map" in result.output and "--trust-remote-code" in result.output
    assert not ran.exists() and not (tmp_path / "cache").exists()


# ---------------------------------------------------------------------------------------------------------------
# 6. the caller's RNG and the model are left alone


def rng_snapshot():
    np_state = np.random.get_state()
    return random.getstate(), (np_state[0], np_state[1].tobytes(), *np_state[2:]), torch.get_rng_state().clone()


def assert_same_rng(a, b):
    assert a[0] == b[0], "python random state changed"
    assert a[1] == b[1], "numpy random state changed"
    assert torch.equal(a[2], b[2]), "torch random state changed"


def test_run_precompute_leaves_global_rng_and_checkpoint_unchanged(llama_dir, tmp_path, monkeypatch):
    from precompute import job
    from runtime.checkpoint import Checkpoint
    from schemas.stamps import model_hash

    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(10, seed=19))
    checkpoint, hash_before = dir_state(llama_dir), model_hash(llama_dir)
    real_load = Checkpoint.load_model

    def load_drawing_random_numbers(*args, **kwargs):  # as a random init or dropout in the reference would
        random.random(), np.random.rand(), torch.rand(3)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(Checkpoint, "load_model", load_drawing_random_numbers)
    cfg = lambda out: job.PrecomputeConfig(model=str(llama_dir), data=str(data), out=str(out), progress=False)  # noqa: E731

    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    before = rng_snapshot()
    summary = job.run_precompute(cfg(tmp_path / "a"), log=lambda m: None)
    assert summary["rows_scored"] == 10
    assert_same_rng(rng_snapshot(), before)
    assert dir_state(llama_dir) == checkpoint and model_hash(llama_dir) == hash_before

    # Control: with the guard made a no-op, the same job moves every generator, so the check above can fail.
    monkeypatch.setattr(job, "preserved_rng", contextlib.nullcontext)
    job.run_precompute(cfg(tmp_path / "b"), log=lambda m: None)
    after = rng_snapshot()
    assert after[0] != before[0] and after[1] != before[1] and not torch.equal(after[2], before[2])


def test_scoring_leaves_the_model_parameters_unchanged(llama_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from runtime.data import Source, encode_rows
    from precompute.job import score_pairs
    from schemas.encoding import EncodingConfig

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.train()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rows = pref_rows(6, seed=23)
    encoded = encode_rows(Source(rows, [("x", i) for i in range(6)], ["x"]), tokenizer, EncodingConfig())
    chosen, rejected, _ = score_pairs(model, encoded.pairs, tokenizer.pad_token_id, token_budget=64)
    assert len(chosen) == len(rejected) == 6
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    assert torch.is_grad_enabled()


# ---------------------------------------------------------------------------------------------------------------
# 7. --help


def test_help_is_generated_from_the_config_fields():
    """Options come from PrecomputeConfig and EncodingConfig themselves (no hand-kept list to drift): every field is
    an option in both spellings, with its metadata's words and the dataclass's default."""
    import dataclasses

    from precompute.job import PrecomputeConfig
    from schemas.encoding import EncodingConfig

    result = CliRunner().invoke(main, ["--help"], terminal_width=400)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for name in ("Model options:", "Data options:", "Encoding options:", "Computation options:", "Output options:"):
        assert name in text
    for cls in (PrecomputeConfig, EncodingConfig):
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli") is False:
                assert f"--{f.name.replace('_', '-')}" not in text
                continue
            assert f"--{f.name.replace('_', '-')}" in text and f"--{f.name}" in text
            assert " ".join(f.metadata["help"].split()) in text
            default = f.default if f.default is not dataclasses.MISSING else None
            if default is not None:
                assert " ".join(f.metadata["help"].split()) + f" [default: {default}]" in text
