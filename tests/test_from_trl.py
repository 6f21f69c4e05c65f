"""What a TRL / Trainer user expects (issue 16): one test per numbered item of the issue."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import pref_rows, write_jsonl
from trl_tokenizers import gpt2_style, llama_style

from runtime.data import DataError, encode_rows, load_rows
from runtime.errors import JobError
from schemas.encoding import EncodingConfig, encode_pair

TRAIN = ["--use-cpu", "--max-steps", "1", "--per-device-train-batch-size", "4", "--logging-steps", "1", "--no-plot"]


# 1. an unknown split is an error listing the available ones (never every file)


def test_unknown_split_lists_the_available_ones(tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", pref_rows(3))
    write_jsonl(tmp_path / "d" / "eval.jsonl", pref_rows(2, seed=1))
    with pytest.raises(DataError, match=r"no split 'validation'; available: test, train"):
        load_rows(tmp_path / "d", "validation")
    assert len(load_rows(tmp_path / "d", "train").rows) == 3
    assert len(load_rows(tmp_path / "d", "test").rows) == 2  # eval.jsonl is split test, as in datasets


# 2. BOS follows the tokenizer and the template; old caches keep their encoding


@pytest.mark.parametrize("fmt", ["standard", "conversational", "implicit"])
def test_bos_follows_the_tokenizer_and_template(fmt):
    row = pref_rows(1, fmt=fmt)[0]
    for tok, has_bos in ((gpt2_style(), False), (llama_style(), True)):
        pair = encode_pair(row, tok, EncodingConfig())
        assert (pair.prompt_ids[0] == tok.bos_token_id) is has_bos, (fmt, type(tok))
        assert pair.prompt_ids.count(tok.bos_token_id) == int(has_bos)  # never twice
        if fmt == "conversational":  # what the template renders, token for token
            text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            assert pair.prompt_ids == tok(text, add_special_tokens=False)["input_ids"]
        elif fmt == "standard":
            assert pair.prompt_ids == tok(row["prompt"])["input_ids"]


def test_old_caches_keep_always_bos_and_a_missing_rule_is_refused():
    old = {"add_bos": True, "add_eos": True, "chat_template": "auto", "max_length": 1024,
           "truncation_mode": "keep_start"}  # what every cache before the tokenizer rule records
    cfg = EncodingConfig.from_dict(old)
    assert cfg.to_json() == json.dumps(old, sort_keys=True, separators=(",", ":"))  # checksums over it unchanged
    tok = gpt2_style()
    assert encode_pair(pref_rows(1)[0], tok, cfg).prompt_ids[0] == tok.bos_token_id
    assert EncodingConfig().add_bos == "tokenizer"
    with pytest.raises(ValueError, match="no add_bos recorded"):
        EncodingConfig.from_dict({k: v for k, v in old.items() if k != "add_bos"})


# 3. numbers in CSV text columns are text


def test_csv_numbers_are_text(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("id,prompt,chosen,rejected\na,What is 2+2?,4,5\nb,And 3+3?,6,7.0\n")
    source = load_rows(path)
    assert [r["chosen"] for r in source.rows] == ["4", "6"] and source.rows[1]["rejected"] == "7.0"
    assert len(encode_rows(source, gpt2_style(), EncodingConfig()).pairs) == 2


# 4. the summary states one accuracy, named (no kl_k3: tests/test_losses.py)


def test_summary_names_one_accuracy():
    from dpo.cli import summary_text

    text = summary_text({"eval": {"eval_rewards/accuracies": 0.75}, "output_dir": "o", "steps": 3, "train_s": 1.0,
                         "verify_s": 0.1, "train_loss": 0.5, "eval_start": {"eval_logps/accuracies": 0.4}})
    assert "eval reward accuracy 0.750" in text and "0.400" not in text and "preferred" not in text


# 5. options: every TrainingArguments field, both spellings, grouped help, DPOConfig YAML, resume true


def test_every_training_argument_is_an_option_in_both_spellings():
    import transformers

    from dpo.cli import main

    text = CliRunner().invoke(main, ["--help"], terminal_width=200).output
    for section in ("Data options:", "Reference cache options:", "Loss options:", "Training options:"):
        assert section in text
    for f in dataclasses.fields(transformers.TrainingArguments):
        if f.init and not f.name.startswith("_") and f.name not in ("debug", "remove_unused_columns"):
            assert f"--{f.name.replace('_', '-')}" in text and f"--{f.name}" in text, f.name
    assert "The exponential decay rate for the first moment" in text  # described in words (transformers' own help)


def test_trainer_options_reach_training_arguments():
    from dpo.cli import resolve_config

    cfg = resolve_config(None, {"model": "m", "data": "d", "output_dir": "o", "adam_beta1": 0.8, "run_name": "exp-7",
                                "learning_rate": 2e-4, "use_cpu": True, "label_names": ("a", "b")})
    args = cfg.training_arguments()
    assert (args.adam_beta1, args.run_name, args.learning_rate, args.label_names) == (0.8, "exp-7", 2e-4, ["a", "b"])
    assert args.remove_unused_columns is False


def test_underscore_spelling_on_the_command_line(tmp_path):
    from dpo.cli import main

    result = CliRunner().invoke(main, ["--model", "m", "--data", "d", "--output_dir", str(tmp_path / "o"),
                                       "--learning_rate", "1e-4", "--ref_cache", str(tmp_path / "none")])
    assert result.exit_code == 2
    assert "no such option" not in result.output.lower()  # parsed; refused later for the missing model


def test_trl_dpo_config_yaml(tmp_path):
    import yaml
    from trl import DPOConfig

    from dpo.cli import load_config_file

    trl = DPOConfig(output_dir=str(tmp_path / "o"), beta=0.3, learning_rate=5e-7, loss_type=["ipo"], use_cpu=True,
                    bf16=False)
    keys = {f.name for f in dataclasses.fields(DPOConfig) if f.init}
    data = {k: getattr(trl, k) for k in ("output_dir", "beta", "learning_rate", "loss_type", "max_length",
                                         "precompute_ref_log_probs", "padding_free")}
    data |= {"model_name_or_path": "org/sft", "dataset_name": "org/prefs"}
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(data))
    values = load_config_file(str(path))
    assert values["beta"] == 0.3 and values["loss_type"] == "ipo" and values["learning_rate"] == 5e-7
    assert values["model"] == "org/sft" and values["data"] == "org/prefs"
    assert "precompute_ref_log_probs" not in values  # at TRL's default: changes nothing, ignored with a note
    data["padding_free"] = True  # a DPOConfig key we do not support, set away from its default
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(Exception, match="unknown option\\(s\\) padding_free"):
        load_config_file(str(path))
    assert "padding_free" in keys


def test_resume_true_means_the_latest_checkpoint(tmp_path):
    from dpo.recipe import latest_checkpoint

    for n in (5, 20, 10):
        (tmp_path / f"checkpoint-{n}").mkdir()
    assert latest_checkpoint("true", tmp_path) == str(tmp_path / "checkpoint-20")
    assert latest_checkpoint("False", tmp_path) is None
    assert latest_checkpoint(str(tmp_path / "checkpoint-5"), tmp_path) == str(tmp_path / "checkpoint-5")
    with pytest.raises(JobError, match="no checkpoint-N folder"):
        latest_checkpoint("true", tmp_path / "empty")


# 6. models and data by hub id, through the local Hugging Face cache


def _hub_snapshot(kind: str, repo: str, files: dict[str, Path]) -> Path:
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE) / f"{kind}s--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    (root / "blobs").mkdir(exist_ok=True)
    for i, (name, src) in enumerate(files.items()):  # as the hub lays it out: snapshot files link into blobs/
        shutil.copy(src, root / "blobs" / f"blob{i}")
        (snap / name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    return snap


def test_model_and_data_by_hub_id(llama_dir, tmp_path):
    from runtime.hub import resolve_model
    from schemas.stamps import model_hash

    _hub_snapshot("model", "acme/tiny-sft", {p.name: p for p in llama_dir.iterdir() if p.is_file()})
    write_jsonl(tmp_path / "train.jsonl", pref_rows(4))
    _hub_snapshot("dataset", "acme/prefs", {"train.jsonl": tmp_path / "train.jsonl"})
    resolved = resolve_model("acme/tiny-sft")
    assert Path(resolved).is_dir() and model_hash(resolved) == model_hash(llama_dir)
    assert len(load_rows("acme/prefs", "train").rows) == 4
    with pytest.raises(JobError, match=r"not found locally.*hf download acme/missing"):
        resolve_model("acme/missing")
    with pytest.raises(JobError, match=r"hf download acme/nodata --repo-type dataset"):
        load_rows("acme/nodata")


# 7. eval split `test`; --eval-data without --eval-ref-cache says what to run


def test_eval_data_without_its_cache_says_what_to_run(tmp_path, llama_dir, dpo_data, dpo_cache):
    from dpo.recipe import TrainConfig, run_train

    assert TrainConfig(model="m", data="d", output_dir="o").eval_split == "test"
    cfg = TrainConfig(model=str(llama_dir), data=str(dpo_data), output_dir=str(tmp_path / "o"),
                      ref_cache=str(dpo_cache), eval_data=str(tmp_path / "eval.jsonl"), use_cpu=True)
    with pytest.raises(JobError, match=r"run `precompute-ref --model .* --split test --out EVAL_CACHE`.*--eval-ref-cache"):
        run_train(cfg)
    assert not (tmp_path / "o").exists()


# 8. the Trainer's progress bar survives quietened libraries


def test_progress_bar_is_on():
    from dpo.recipe import TrainConfig
    from runtime.cli import quiet_libraries

    quiet_libraries()
    assert TrainConfig(model="m", data="d", output_dir="o", use_cpu=True).training_arguments().disable_tqdm is False


# 9. trackers are checked before any work


def test_missing_tracker_is_refused_first(tmp_path):
    import importlib.util

    from dpo.recipe import TrainConfig, run_train

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    cfg = TrainConfig(model=str(tmp_path / "no-model"), data="d", output_dir=str(tmp_path / "o"),
                      ref_cache=str(tmp_path / "no-cache"), report_to="wandb", use_cpu=True)
    with pytest.raises(JobError, match=r"--report-to wandb: the wandb package is not installed; install it with `pip install wandb`"):
        run_train(cfg)
    import tomllib

    extras = tomllib.loads(Path(__file__).resolve().parents[1].joinpath("pyproject.toml").read_text())
    assert "tensorboard" in extras["project"]["optional-dependencies"]


# 11. mismatch messages say what differs


def test_tokenizer_mismatch_names_the_differing_parts(llama_dir, dpo_cache, dpo_data):
    from transformers import AutoTokenizer

    from dpo.verify import verify_and_join
    from schemas.format import StampMismatch

    tok = AutoTokenizer.from_pretrained(llama_dir)
    tok.chat_template = tok.chat_template.replace("|>\n", "|>: ")
    with pytest.raises(StampMismatch, match=r"it differs in: chat_template\n") as e:
        verify_and_join(tokenizer=tok, model_dir=str(llama_dir), data=str(dpo_data), split="train",
                        cache_dir=str(dpo_cache), log=lambda m: None)
    assert "it differs in: chat_template" in str(e.value).splitlines()[0]


def test_conversational_cache_with_standard_data_says_the_template_differs(tmp_path, llama_dir, dpo_cache):
    from transformers import AutoTokenizer

    from dpo.verify import verify_and_join

    standard = write_jsonl(tmp_path / "std.jsonl", pref_rows(40, fmt="standard"))  # same ids r0000.., no template
    with pytest.raises(Exception, match="chat-template rendering differs"):
        verify_and_join(tokenizer=AutoTokenizer.from_pretrained(llama_dir), model_dir=str(llama_dir),
                        data=str(standard), split="train", cache_dir=str(dpo_cache), log=lambda m: None)


def test_eval_cache_given_as_ref_cache_says_so(tmp_path, llama_dir):
    from transformers import AutoTokenizer

    from dpo.verify import verify_and_join
    from precompute.job import PrecomputeConfig, run_precompute

    write_jsonl(tmp_path / "d" / "train.jsonl", pref_rows(6))
    write_jsonl(tmp_path / "d" / "eval.jsonl", pref_rows(4, seed=3))
    run_precompute(PrecomputeConfig(model=str(llama_dir), data=str(tmp_path / "d"), split="test",
                                    out=str(tmp_path / "eval-cache"), progress=False), log=lambda m: None)
    with pytest.raises(Exception, match=r"the cache holds split 'test' \(the eval split's cache\).*--eval-ref-cache"):
        verify_and_join(tokenizer=AutoTokenizer.from_pretrained(llama_dir), model_dir=str(llama_dir),
                        data=str(tmp_path / "d"), split="train", cache_dir=str(tmp_path / "eval-cache"),
                        log=lambda m: None)


# 12. bad bytes name the file, the line and the problem


def test_non_utf8_csv_names_file_and_line(tmp_path):
    path = tmp_path / "p.csv"
    path.write_bytes(b"id,prompt,chosen,rejected\na,ok,yes,no\nb,caf\xe9,yes,no\n")
    with pytest.raises(DataError, match=r"p\.csv: line 3 is not valid UTF-8 \(invalid continuation byte: byte 0xe9"):
        load_rows(path)


# 13. the cache read by a glob (the README's one-liners) and by schemas.read_cache


def test_cache_one_liners(dpo_cache):
    import pandas as pd
    import polars as pl

    from schemas import read_cache

    manifest = json.loads((dpo_cache / "manifest.json").read_text())
    ids = read_cache(dpo_cache).select("id").collect()["id"].to_list()
    assert len(ids) == manifest["rows"] == 40
    glob = pl.scan_parquet(f"{dpo_cache}/*.parquet").select("id").collect()["id"].to_list()
    assert sorted(glob) == sorted(ids)
    frame = pd.read_parquet(sorted(str(p) for p in dpo_cache.glob("*.parquet")))
    assert sorted(frame["id"]) == sorted(ids)


# 14. --bf16 is autocast over float32 master weights; --bf16 on CPU names --use-cpu


def test_bf16_keeps_float32_weights(tmp_path, llama_dir, dpo_data, dpo_cache):
    from safetensors import safe_open

    from dpo.cli import main

    out = tmp_path / "o"
    result = CliRunner().invoke(main, ["--model", str(llama_dir), "--data", str(dpo_data), "--ref-cache",
                                       str(dpo_cache), "--output-dir", str(out), "--bf16", *TRAIN])
    assert result.exit_code == 0, result.output
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    result = CliRunner().invoke(main, ["--model", str(llama_dir), "--data", str(dpo_data), "--ref-cache",
                                       str(dpo_cache), "--output-dir", str(tmp_path / "o2"), "--bf16", "--max-steps", "1"])
    import torch

    if not torch.cuda.is_available():
        assert result.exit_code == 2 and "add --use-cpu" in result.output
