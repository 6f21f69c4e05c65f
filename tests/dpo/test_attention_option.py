"""train-dpo --attn-implementation (issue 36, finding E): TRL's ModelConfig.attn_implementation, as precompute-ref
takes it (runtime/placed.py Attention): the policy (and a live reference) loads with it, in both spellings and in a
--config; one the model cannot use is refused (exit 2) naming those it can, before anything is written."""

from __future__ import annotations

import json

from click.testing import CliRunner

from dpo.cli import main
from dpo.config_file import load_config_file

TRAIN = ["--use-cpu", "--max-steps", "1", "--per-device-train-batch-size", "4", "--logging-steps", "1", "--no-plot"]


def _cli(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_train_dpo_trains_with_the_attention_asked_for(tmp_path, llama_dir, dpo_data, dpo_cache):
    """The tiny Llama loads with sdpa by default; eager asked for is what the policy runs (the batch layout's probe
    names the policy's attention) and what the run manifest records."""
    out = tmp_path / "out"
    result = _cli(["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out, *TRAIN,
                   "--batch-layout", "prefix_shared", "--attn_implementation", "eager"])
    assert result.exit_code == 0, result.output
    assert "batch layout: prefix_shared (eager attention" in result.output, result.output
    assert json.loads((out / "run-manifest.json").read_text())["config"]["attn_implementation"] == "eager"


def test_an_attention_the_model_cannot_use_is_refused_naming_those_it_can(tmp_path, llama_dir, dpo_data, dpo_cache):
    out = tmp_path / "out"
    result = _cli(["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out, *TRAIN,
                   "--attn-implementation", "bogus"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"error: --model {llama_dir}: the model cannot be loaded with --attn-implementation bogus" in text, text
    assert "it supports: eager, sdpa" in text and "or leave --attn-implementation at auto" in text, text
    assert not out.exists()


def test_attn_implementation_in_a_config_file(tmp_path):
    """TRL's key in a `trl dpo` YAML is the option (it was an unknown key before); null is TRL's default."""
    path = tmp_path / "run.yaml"
    path.write_text("attn_implementation: sdpa\n")
    assert load_config_file(str(path)) == {"attn_implementation": "sdpa"}
    path.write_text("attn_implementation: null\nbeta: 0.2\n")
    assert load_config_file(str(path)) == {"beta": 0.2}
