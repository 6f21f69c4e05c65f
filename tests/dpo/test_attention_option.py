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


def test_an_attention_that_is_not_one_is_refused_where_the_options_are_read(tmp_path, llama_dir, dpo_data, dpo_cache):
    """Found by the UX pass: a bad value was refused only after the cache was verified; now as the options are read
    (exit 2, nothing verified or loaded), naming the option, or the config file and its key."""
    out = tmp_path / "out"
    args = ["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out, *TRAIN]
    result = _cli([*args, "--attn-implementation", "bogus"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "Invalid value for '--attn-implementation'" in text, text
    assert "'bogus' is not an attention implementation; use one of auto, eager, sdpa" in text, text
    assert "verified" not in text and not out.exists()
    config = tmp_path / "run.yaml"
    config.write_text("attn_implementation: bogus\n")
    result = _cli(["--config", config, *args])
    assert result.exit_code == 2, result.output
    assert f"{config}: attn_implementation: 'bogus' is not an attention implementation" in " ".join(
        result.output.split()), result.output


def test_flash_attention_without_its_package_is_refused_saying_so(tmp_path, llama_dir, dpo_data, dpo_cache,
                                                                 monkeypatch):
    """Found by the UX pass: flash_attention_2 without flash_attn was refused listing flash_attention_2 among the
    supported values; the refusal says it is supported, what to install, and lists only what works here."""
    from precompute.cli import main as precompute
    from runtime import placed

    monkeypatch.setattr(placed, "_installed", lambda module: False)  # whatever this machine has
    out = tmp_path / "out"
    result = _cli(["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out, *TRAIN,
                   "--attn-implementation", "flash_attention_2"])
    made = CliRunner().invoke(precompute, [str(a) for a in ("--model", llama_dir, "--data", dpo_data, "--out",
                                                            tmp_path / "cache", "--attn_implementation",
                                                            "flash_attention_2")])
    for refused in (result, made):
        assert refused.exit_code == 2, refused.output
        text = " ".join(refused.output.split())
        assert ("flash_attention_2 is supported, but its package is not installed here (flash_attn: pip install "
                "flash-attn, on a CUDA machine); use one of auto, eager, sdpa, flex_attention (on CUDA)") in text, text
        assert text.count("flash_attention") == 1, text  # listed nowhere else
    assert not out.exists() and not (tmp_path / "cache").exists()
    monkeypatch.setattr(placed, "_installed", lambda module: module == "flash_attn")
    assert placed.parse_attention("flash_attention_2") == "flash_attention_2"
    assert "flash_attention_2" in placed.attention_here() and "flash_attention_3" not in placed.attention_here()


def test_attn_implementation_in_a_config_file(tmp_path):
    """TRL's key in a `trl dpo` YAML is the option (it was an unknown key before); null is TRL's default."""
    path = tmp_path / "run.yaml"
    path.write_text("attn_implementation: sdpa\n")
    assert load_config_file(str(path)) == {"attn_implementation": "sdpa"}
    path.write_text("attn_implementation: null\nbeta: 0.2\n")
    assert load_config_file(str(path)) == {"beta": 0.2}


def test_flex_attention_on_cpu_is_refused_before_any_work(tmp_path, llama_dir, dpo_data, dpo_cache):
    """Found by the UX passes: train-dpo --attn_implementation flex_attention on CPU stopped at its first step with
    'unexpected NotImplementedError' (no backward on CPU), precompute-ref in inductor's C++ build; then both were
    refused only after the data, the tokenizer and the cache were read. Now refused as the job starts (issue 36): the
    data file here is not even JSON and is never read; exit 2, the option named as typed (or the config file's key),
    with the device option that chose the CPU and what works here; nothing written."""
    from precompute.cli import main as precompute

    broken = tmp_path / "broken.jsonl"
    broken.write_text("not json\n")
    out = tmp_path / "out"
    result = _cli(["--model", llama_dir, "--data", broken, "--ref-cache", dpo_cache, "--output-dir", out, *TRAIN,
                   "--attn_implementation", "flex_attention"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert ("error: --attn_implementation flex_attention needs a CUDA device, and --use-cpu runs it on the CPU"
            in said), said
    assert "use one of auto, eager, sdpa" in said and "broken" not in said, said
    assert not out.exists()
    cache = tmp_path / "cache"
    config = tmp_path / "run.yaml"
    config.write_text("attn_implementation: flex_attention\n")
    made = CliRunner().invoke(precompute, [str(a) for a in ("--model", llama_dir, "--data", broken, "--out", cache,
                                                            "--config", config, "--device", "cpu", "--no-progress")])
    said = " ".join(made.output.split())
    assert made.exit_code == 2, made.output
    assert (f"error: {config}: attn_implementation: flex_attention needs a CUDA device, and --device cpu runs it "
            "on the CPU") in said, said
    assert "broken" not in said and not cache.exists()


def test_lora_target_modules_as_a_list_in_a_config_is_read_as_its_names():
    """Found by the UX pass: `lora_target_modules: [q_proj, v_proj]` (TRL's configs write a list) crashed with
    'unexpected AttributeError'."""
    from dpo.lora import target_modules

    assert target_modules(["q_proj", "v_proj"]) == ["q_proj", "v_proj"] == target_modules("q_proj, v_proj")
    assert target_modules(["all-linear"]) == "all-linear"
