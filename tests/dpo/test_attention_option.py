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


def test_flex_attention_on_cpu_is_refused_before_the_model_loads(tmp_path, llama_dir, dpo_data, dpo_cache):
    """Found by the UX pass: train-dpo --attn_implementation flex_attention on CPU stopped at its first step with
    'unexpected NotImplementedError' (no backward on CPU), precompute-ref in inductor's C++ build; both are refused,
    exit 2, nothing written."""
    from precompute.cli import main as precompute

    out = tmp_path / "out"
    result = _cli(["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out, *TRAIN,
                   "--attn_implementation", "flex_attention"])
    assert result.exit_code == 2, result.output
    assert "--attn-implementation flex_attention needs a CUDA device" in " ".join(result.output.split())
    assert not out.exists()
    cache = tmp_path / "cache"
    made = CliRunner().invoke(precompute, [str(a) for a in ("--model", llama_dir, "--data", dpo_data, "--out", cache,
                                                            "--attn-implementation", "flex_attention",
                                                            "--no-progress")])
    assert made.exit_code == 2 and "needs a CUDA device" in " ".join(made.output.split()), made.output
    assert not any(cache.glob("*.parquet"))


def test_lora_target_modules_as_a_list_in_a_config_is_read_as_its_names():
    """Found by the UX pass: `lora_target_modules: [q_proj, v_proj]` (TRL's configs write a list) crashed with
    'unexpected AttributeError'."""
    from dpo.lora import target_modules

    assert target_modules(["q_proj", "v_proj"]) == ["q_proj", "v_proj"] == target_modules("q_proj, v_proj")
    assert target_modules(["all-linear"]) == "all-linear"
