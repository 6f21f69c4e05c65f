"""runtime/data.py: loading preference data (every container and TRL format, splits, CSV, bad bytes) and encoding it
row by row (bad rows name file, row and reason). The container tests run precompute-ref end to end: the cache of
every container is byte-identical to the .jsonl run's."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import gpt2_style, manifest_of, pref_rows, read_cache, shard_hashes, write_jsonl
from conftest import precompute_ok as ok
from runtime.data import DataError, encode_rows, load_rows, row_format
from schemas.cache import open_cache
from schemas.encoding import EncodingConfig

FORMATS = ["standard", "conversational", "implicit"]


# ---------------------------------------------------------------------------------------------------------------
# each TRL format in each container loads to the rows as written


@pytest.mark.parametrize("data_format", FORMATS)
def test_every_container_loads_the_rows_as_written(tmp_path, data_format):
    rows = format_rows(data_format)
    containers = CONTAINERS + (["csv"] if data_format == "standard" else [])
    for container in ["jsonl", *containers]:
        data, extra = write_container(container, rows, tmp_path / container)
        source = load_rows(data, extra[1] if extra else "train")
        assert source.rows == rows, container
        assert [row_format(r) for r in source.rows] == [data_format] * len(rows)
        assert source.fingerprint == load_rows(tmp_path / "jsonl" / "prefs.jsonl").fingerprint
        if container in ("jsonl", "json_lines_in_json"):  # JSON Lines: the row number is the line number
            assert [n for _, n in source.locations] == list(range(1, len(rows) + 1))
        if container == "dir":  # two train files in name order; test.jsonl belongs to another split
            assert [Path(f).name for f in source.files] == ["train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl"]
            assert [(Path(f).name, n) for f, n in source.locations][6] == ("train-00001-of-00002.jsonl", 1)


def test_the_three_formats_encode_to_the_same_pairs_where_their_content_agrees(tokenizer, tmp_path):
    """A conversational row rendered by the chat template, the same text as a standard row, and that standard row
    with its prompt folded into both completions (implicit): the encoder sees the same prompt/completion split."""
    cfg = EncodingConfig(chat_template="off")
    std = pref_rows(6, seed=2, fmt="standard")
    implicit = [{"id": r["id"], "chosen": r["prompt"] + " " + r["chosen"], "rejected": r["prompt"] + " " + r["rejected"]}
                for r in std]
    a = encode_rows(load_rows(write_jsonl(tmp_path / "s.jsonl", std)), tokenizer, cfg)
    b = encode_rows(load_rows(write_jsonl(tmp_path / "i.jsonl", implicit)), tokenizer, cfg)
    assert a.ids == b.ids == [r["id"] for r in std]
    assert [p.prompt_ids for p in a.pairs] == [p.prompt_ids for p in b.pairs]
    assert a.formats == {"standard": 6} and b.formats == {"implicit": 6} and a.templated is b.templated is False
    conv = encode_rows(load_rows(write_jsonl(tmp_path / "c.jsonl", pref_rows(6, seed=2, fmt="conversational"))),
                       tokenizer, EncodingConfig())
    assert conv.templated is True and conv.ids == a.ids
    for pair, row in zip(conv.pairs, pref_rows(6, seed=2, fmt="conversational")):
        text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        assert pair.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------------------------
# bad rows name the file, the row and the reason


def test_bad_row_names_file_row_and_reason(tokenizer, tmp_path):
    good = [json.dumps(r) for r in pref_rows(4, seed=8)]
    lines = [good[0], "", good[1], '{"id": "x", "prompt": "why?", "rejected": "no"}', "{not json", good[2], good[1]]
    path = tmp_path / "prefs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    source = load_rows(path)
    with pytest.raises(DataError) as e:  # the first bad row stops the run: line 4 (line 2 is blank)
        encode_rows(source, tokenizer, EncodingConfig())
    assert (e.value.file, e.value.row) == (str(path), 4) and "chosen" in e.value.reason
    assert str(e.value).startswith(f"{path}, row 4: ")
    skipped = encode_rows(source, tokenizer, EncodingConfig(), on_bad_row="skip")
    assert skipped.ids == ["r0000", "r0001", "r0002"]
    assert [(s["row"], s["reason"]) for s in skipped.skipped] == [(4, "missing_field"), (5, "bad_json"),
                                                                  (7, "duplicate_id")]
    assert "already used at" in skipped.skipped[2]["detail"] and f"{path}, row 3" in skipped.skipped[2]["detail"]
    assert skipped.skipped_by_reason == {"bad_json": 1, "duplicate_id": 1, "missing_field": 1}


@pytest.mark.parametrize("line,detail", [("not json at all", "Expecting value at column 1"),
                                         ('{"id": "r0022", "prompt":', "Expecting value at column 26")])
def test_unparsable_line_is_ours_alone(tokenizer, tmp_path, line, detail):
    """Issue 25 item 5: datasets logs its parser's failure with a 0-based row of its own ("Failed to load JSON ...
    row 22") before it raises; only refcache's message remains: the file, the 1-based line, the reason at a column
    of that line."""
    import logging

    lines = [json.dumps(r) for r in pref_rows(30, seed=8)]
    lines[22] = line
    path = tmp_path / "prefs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    heard = []
    handler = logging.Handler()
    handler.emit = heard.append
    library = logging.getLogger("datasets")  # the library's root logger: its handler writes to stderr
    library.addHandler(handler)
    try:
        source = load_rows(path)
    finally:
        library.removeHandler(handler)
    assert [r.getMessage() for r in heard if r.levelno >= logging.ERROR] == []
    with pytest.raises(DataError) as e:
        encode_rows(source, tokenizer, EncodingConfig())
    assert str(e.value) == f"{path}, row 23: bad_json: unparsable JSON ({detail})"


def test_no_usable_rows_is_one_refusal_naming_the_data_and_the_skips(tokenizer, tmp_path):
    """Issue 22 item 14: every row skipped (or none there) is refused here, for precompute-ref and train-dpo alike."""
    from runtime.data import Source, usable_rows

    path = tmp_path / "prefs.jsonl"
    path.write_text('{"id": "a", "prompt": "why?", "chosen": "yes</s>", "rejected": "no"}\n{"id": "b", "prompt": "x"}\n')
    source = load_rows(path)
    with pytest.raises(DataError) as e:
        usable_rows(source, tokenizer, EncodingConfig(), "skip", str(path))
    assert str(e.value) == (f"{path}: no usable rows (2 skipped: {{'missing_field': 1, 'special_token_text': 1}})")
    with pytest.raises(DataError, match=r"^data: no usable rows \(0 skipped: \{\}\)$"):  # an empty saved data set
        usable_rows(Source([], [], []), tokenizer, EncodingConfig(), "skip", "data")
    assert encode_rows(source, tokenizer, EncodingConfig(), on_bad_row="skip").pairs == []  # audit still compares


def test_an_invalid_chat_template_is_a_job_error_not_a_bad_row(tokenizer, tmp_path):
    import copy

    from runtime.errors import JobError

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% if messages %}{{ messages[0]['content'] }}"  # no endif
    source = load_rows(write_jsonl(tmp_path / "prefs.jsonl", pref_rows(3, fmt="conversational")))
    for on_bad_row in ("error", "skip"):  # skipping cannot help: no row can be rendered
        with pytest.raises(JobError, match="is not valid Jinja"):
            encode_rows(source, tok, EncodingConfig(), on_bad_row=on_bad_row)


def test_missing_path_and_unsupported_file_type_are_refused(tmp_path):
    with pytest.raises(DataError, match="nothing.jsonl: does not exist"):
        load_rows(tmp_path / "nothing.jsonl")
    (tmp_path / "prefs.txt").write_text("hello\n")
    with pytest.raises(DataError, match=r"unsupported file type '\.txt'"):
        load_rows(tmp_path / "prefs.txt")


# ---------------------------------------------------------------------------------------------------------------
# issue 16 (what a TRL user expects), item 1: an unknown split is an error listing the available ones (never every file)


def test_unknown_split_lists_the_available_ones(tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", pref_rows(3))
    write_jsonl(tmp_path / "d" / "eval.jsonl", pref_rows(2, seed=1))
    with pytest.raises(DataError, match=r"no split 'validation'; available: test, train"):
        load_rows(tmp_path / "d", "validation")
    assert len(load_rows(tmp_path / "d", "train").rows) == 3
    assert len(load_rows(tmp_path / "d", "test").rows) == 2  # eval.jsonl is split test, as in datasets


# issue 25 (TRL recipes), item 3: --split eval finds eval.jsonl (the help says test/eval): a split is named as the
# files are, or by any name datasets files them under


def test_split_eval_finds_eval_jsonl(tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", pref_rows(3))
    write_jsonl(tmp_path / "d" / "eval.jsonl", pref_rows(2, seed=1))
    assert load_rows(tmp_path / "d", "eval").rows == load_rows(tmp_path / "d", "test").rows == pref_rows(2, seed=1)
    assert load_rows(tmp_path / "d", "evaluation").files == [str(tmp_path / "d" / "eval.jsonl")]


def test_split_synonyms_neighbours(tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", pref_rows(3))
    write_jsonl(tmp_path / "d" / "dev.jsonl", pref_rows(2, seed=1))
    assert len(load_rows(tmp_path / "d", "val").rows) == 2  # dev.jsonl is split validation
    assert len(load_rows(tmp_path / "d", "training").rows) == 3
    with pytest.raises(DataError, match=r"no split 'eval'; available: train, validation"):  # no test files
        load_rows(tmp_path / "d", "eval")
    import datasets

    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(pref_rows(3)),
                          "test": datasets.Dataset.from_list(pref_rows(2, seed=1))}).save_to_disk(str(saved))
    assert load_rows(saved, "eval").rows == pref_rows(2, seed=1)  # a save_to_disk folder: the same rule


# issue 16 (what a TRL user expects), item 3: numbers in CSV text columns are text


def test_csv_numbers_are_text(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("id,prompt,chosen,rejected\na,What is 2+2?,4,5\nb,And 3+3?,6,7.0\n")
    source = load_rows(path)
    assert [r["chosen"] for r in source.rows] == ["4", "6"] and source.rows[1]["rejected"] == "7.0"
    assert len(encode_rows(source, gpt2_style(), EncodingConfig()).pairs) == 2


# issue 16 (what a TRL user expects), item 12: bad bytes name the file, the line and the problem


def test_non_utf8_csv_names_file_and_line(tmp_path):
    path = tmp_path / "p.csv"
    path.write_bytes(b"id,prompt,chosen,rejected\na,ok,yes,no\nb,caf\xe9,yes,no\n")
    with pytest.raises(DataError, match=r"p\.csv: line 3 is not valid UTF-8 \(invalid continuation byte: byte 0xe9"):
        load_rows(path)


# ---------------------------------------------------------------------------------------------------------------
# end to end: every container gives the byte-identical cache, ids without an id column


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
    open_cache(out)  # the project's own verifier accepts it
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
    open_cache(out)


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
# issue 25 (TRL recipes), item 4: --columns reads data whose columns are named otherwise; the demo's stamps unchanged

RENAMED = {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}


def _renamed(rows, names=RENAMED):
    return [{names.get(k, k): v for k, v in r.items()} for r in rows]


@pytest.mark.parametrize("fmt", ["standard", "conversational"])
def test_columns_encode_renamed_data_as_the_original(tmp_path, fmt):
    tok = gpt2_style()
    rows = [{k: v for k, v in r.items() if k != "id"} for r in pref_rows(6, fmt=fmt)]  # ids from the content
    plain = encode_rows(load_rows(write_jsonl(tmp_path / "plain.jsonl", rows)), tok, EncodingConfig())
    cfg = EncodingConfig(columns="prompt=question,chosen=response_j,rejected=response_k")
    renamed = encode_rows(load_rows(write_jsonl(tmp_path / "renamed.jsonl", _renamed(rows))), tok, cfg)
    assert renamed.ids == plain.ids and renamed.pairs == plain.pairs
    with pytest.raises(DataError, match=r"renamed\.jsonl, row 1: missing_field: row has no 'chosen' value .*; if the "
                                         r"data names it otherwise, map it with --columns"):
        encode_rows(load_rows(tmp_path / "renamed.jsonl"), tok, EncodingConfig())  # without it: a hint
    holed = _renamed(rows)
    holed[1]["response_j"] = None
    with pytest.raises(DataError, match=r"holed\.jsonl, row 2: missing_field: row has no 'chosen' value .*"
                                         r"\(--columns prompt=question,chosen=response_j,rejected=response_k\)"):
        encode_rows(load_rows(write_jsonl(tmp_path / "holed.jsonl", holed)), tok, cfg)


def test_columns_errors_name_the_file_and_the_column(tmp_path):
    tok = gpt2_style()
    data = write_jsonl(tmp_path / "d" / "train.jsonl", _renamed(pref_rows(3)))
    with pytest.raises(DataError, match=re.escape(f"{data}: no column 'answer_a' (--columns chosen=answer_a); its "
                                                  "columns: id, question, response_j, response_k")):
        encode_rows(load_rows(data), tok, EncodingConfig(columns="prompt=question,chosen=answer_a"), "skip")
    both = write_jsonl(tmp_path / "both.jsonl", [{**r, "prompt": "kept?"} for r in _renamed(pref_rows(3))])
    with pytest.raises(DataError, match=r"both\.jsonl: it has a column 'prompt' and --columns maps 'question' to "
                                        r"prompt, so one of them would be dropped"):
        encode_rows(load_rows(both), tok, EncodingConfig(columns="prompt=question,chosen=response_j,"
                                                                 "rejected=response_k"))
    # a mapped-away column may be a target: chosen and rejected swapped
    swapped = encode_rows(load_rows(data), tok, EncodingConfig(columns="prompt=question,chosen=response_k,"
                                                                       "rejected=response_j"))
    straight = encode_rows(load_rows(data), tok, EncodingConfig(columns="prompt=question,chosen=response_j,"
                                                                        "rejected=response_k"))
    assert [p.chosen_ids for p in swapped.pairs] == [p.rejected_ids for p in straight.pairs]


def test_the_demo_data_keeps_its_stamps():
    """The mask checksums of data/'s demo under the default encoding, pinned before EncodingConfig had `columns`:
    every cache made before it stays valid."""
    from transformers import AutoTokenizer

    from schemas.stamps import combined_mask_checksum

    tok = AutoTokenizer.from_pretrained(Path(__file__).parents[2] / "data" / "sft-model")
    cfg = EncodingConfig()
    pinned = {"prefs": "47aaa7f4acd61b3a2d1fab7bc1c7b68667d21e125a92d49ae5877f6d68ca56fc",
              "prefs-standard": "8a66de36a9f486727bbe460bac49f847a9945873cc00acccd74c1eb8b729cf55"}
    for name, checksum in pinned.items():
        encoded = encode_rows(load_rows(Path(__file__).parents[2] / "data" / name, "train"), tok, cfg)
        assert combined_mask_checksum([p.mask_checksum for p in encoded.pairs], cfg.to_json()) == checksum, name


def test_a_mistyped_local_path_lists_the_folder_and_suggests_the_closest_file(tmp_path, llama_dir, monkeypatch):
    """`precompute-ref --data d1/trian.jsonl` (a typo of d1/train.jsonl): not hub download advice but what d1 holds
    and the closest name; a --model folder that does not exist is said not to exist."""
    from click.testing import CliRunner

    from precompute.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d1").mkdir()
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / "d1" / name).write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n")
    result = CliRunner().invoke(main, ["--model", str(llama_dir), "--data", "d1/trian.jsonl", "--out", "o"])
    assert result.exit_code == 2, result.output
    assert "d1/trian.jsonl: does not exist; did you mean d1/train.jsonl? (d1 holds: test.jsonl, train.jsonl)" in (
        result.output)
    assert "hf download" not in result.output and not (tmp_path / "o").exists()
    result = CliRunner().invoke(main, ["--model", str(llama_dir) + "x", "--data", "d1/train.jsonl", "--out", "o"])
    assert result.exit_code == 2, result.output
    assert f"{llama_dir}x: does not exist; did you mean {llama_dir}?" in result.output
    assert "no config.json" not in result.output
