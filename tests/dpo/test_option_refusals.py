"""train-dpo's option refusals from the user's side (issue 36, the option-reading side): a model hash is read as the
stamps hold it, a DeepSpeed config is read before the Trainer, each refused naming the option (or the config file's
key) with what it must be; exit 2, nothing written."""

from __future__ import annotations

import importlib.util

import pytest

from click.testing import CliRunner

from dpo.cli import main

TRAIN = ["--use-cpu", "--max-steps", "1", "--per-device-train-batch-size", "4", "--no-plot"]


def _cli(args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _said(result) -> str:
    return " ".join(result.output.split())


def test_ref_model_hash_is_64_lowercase_hex_at_parse_time(tmp_path, llama_dir, dpo_data, dpo_cache):
    """Found by the UX pass: any text was taken and compared with the cache's stamp after the verification; now it
    is refused as the options are read, saying what it must be and where a cache's value is."""
    out = tmp_path / "out"
    args = ["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out, *TRAIN]
    digest = "daa080e41d34848d3786bbce7a9f1c2ebe87d3387dedc9e4e6dcfe45dd5e88ec"
    for given, why in (("xyz", "only the digits 0-9 and a-f"), (digest.upper(), "in lowercase"),
                       (digest[:8], "8 characters given")):
        result = _cli([*args, "--ref-model-hash", given])
        assert result.exit_code == 2, result.output
        said = _said(result)
        assert f"{given} is not a model hash: 64 lowercase hexadecimal digits (a sha256; {why}" in said, said
        assert "stamps.model_hash in CACHE/manifest.json" in said and "verified" not in said, said
    config = tmp_path / "run.yaml"
    config.write_text("ref_model_hash: 12\n")
    result = _cli(["--config", config, *args])
    assert result.exit_code == 2 and f"{config}: ref_model_hash: 12 is not a model hash" in _said(result), \
        result.output
    from runtime.options import model_hash_text

    assert model_hash_text(f" {digest} ") == digest
    assert not out.exists()


def test_a_deepspeed_config_is_refused_naming_what_is_wrong(tmp_path, llama_dir, dpo_data, dpo_cache, monkeypatch):
    """Found by the UX pass: a missing file, a file that is not JSON and a machine without deepspeed all answered
    "a package this run needs is not installed: No package metadata was found for The 'deepspeed>=0.9.3'
    distribution was not found ..."; each now says what it is, naming --deepspeed."""
    out = tmp_path / "out"
    args = ["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out, *TRAIN]
    result = _cli([*args, "--deepspeed", tmp_path / "ds.jsn"])
    assert result.exit_code == 2, result.output
    assert f"--deepspeed {tmp_path / 'ds.jsn'}: does not exist" in _said(result), result.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 2},}\n')
    result = _cli([*args, "--deepspeed", bad])
    assert result.exit_code == 2, result.output
    assert f"error: --deepspeed {bad}: not valid JSON (" in _said(result), result.output
    good = tmp_path / "ds.json"
    good.write_text('{"zero_optimization": {"stage": 2}}\n')
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    result = _cli([*args, "--deepspeed", good])
    assert result.exit_code == 2, result.output
    said = _said(result)
    assert (f"error: --deepspeed {good}: the deepspeed package is not installed here; install it with `pip install "
            "deepspeed`") in said, said
    assert "No package metadata" not in said and not out.exists()


@pytest.mark.parametrize("option", ["deepspeed", "fsdp_config"])
def test_a_json_config_option_is_read_as_a_config_file_is(tmp_path, llama_dir, dpo_data, dpo_cache, option):
    """Every Trainer option that takes a JSON config (dpo/preflight.JSON_CONFIGS, enumerated): JSON that does not
    read (the closing pass: --fsdp-config's said 'invalid training options: Expecting property name', naming neither
    option nor file), a JSON list, and a FIFO (never waited on) are refused naming the option and the file; nothing
    is written."""
    import os

    from dpo.preflight import JSON_CONFIGS

    assert option in JSON_CONFIGS
    flag = "--" + option.replace("_", "-")
    out = tmp_path / "out"
    args = ["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out, *TRAIN]
    bad, listed, fifo = tmp_path / "bad.json", tmp_path / "list.json", tmp_path / "fifo.json"
    bad.write_text('{"a": 1,}\n')
    listed.write_text("[1, 2]\n")
    os.mkfifo(fifo)
    for path, said in ((bad, "not valid JSON ("), (listed, "is a JSON object, not list"),
                       (fifo, "not a regular file")):
        result = _cli([*args, flag, path])
        assert result.exit_code == 2, result.output
        text = _said(result)
        assert text.startswith(f"error: {flag} {path}: ") and said in text and f"{path}: {path}" not in text, text
    assert not out.exists()


def test_a_split_that_selects_nothing_in_one_file_is_refused(tmp_path, llama_dir, dpo_data, dpo_cache):
    """Found by the UX pass (issue 36): `precompute-ref --split test --data one_file.jsonl` recorded split test in the
    manifest though it selected nothing. One file holds one split, the one its name says as datasets names a folder's
    files (eval.jsonl is test; prefs.jsonl train): that is recorded, and a --split (train-dpo's --split and
    --eval-split alike, TRL's spellings too) naming another is refused, naming the option as typed."""
    import json
    import shutil

    from precompute.cli import main as precompute

    cache = tmp_path / "cache"
    made = CliRunner().invoke(precompute, [str(a) for a in ("--model", llama_dir, "--data", dpo_data, "--split", "test",
                                                            "--out", cache, "--no-progress")])
    assert made.exit_code == 2, made.output
    said = _said(made)
    assert (f"error: --split test: --data {dpo_data} is one file, which holds one split (train, by its name, as "
            "datasets names the files of a folder), so --split test would select nothing in it; leave it out") \
        in said, said
    assert not cache.exists()
    evaluation = tmp_path / "eval.jsonl"
    shutil.copy(dpo_data, evaluation)
    made = CliRunner().invoke(precompute, [str(a) for a in ("--model", llama_dir, "--data", evaluation, "--split",
                                                            "eval", "--out", cache, "--no-progress")])
    assert made.exit_code == 0, made.output
    assert json.loads((cache / "manifest.json").read_text())["source"]["split"] == "test"  # what was read
    out = tmp_path / "out"
    args = ["--model", llama_dir, "--ref-cache", dpo_cache, "--output-dir", out, *TRAIN]
    result = _cli([*args, "--data", dpo_data, "--dataset_train_split", "test"])
    assert result.exit_code == 2, result.output
    assert f"error: --dataset_train_split test: --data {dpo_data} is one file" in _said(result), result.output
    result = _cli([*args, "--data", dpo_data, "--eval-data", dpo_data, "--eval-split", "test", "--eval-ref-cache",
                   dpo_cache])
    assert result.exit_code == 2, result.output
    assert f"error: --eval-split test: --eval-data {dpo_data} is one file" in _said(result), result.output
    assert not out.exists()
