"""dpo/cli.py: TRL recipes that carry over (issue 25, item 3): a YAML dumped from `DPOConfig(...).to_dict()` loads
and trains, TRL's ModelConfig / ScriptArguments names (dtype, model_name_or_path, ...) work in a file and on the
command line through one alias table, and TRL's RPO (`loss_type: [sigmoid, sft]`) is refused with the --rpo-alpha
hint, because its SFT term is not refcache's."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
import torch
import yaml
from click.testing import CliRunner

from dpo.cli import TRL_ALIASES, main, resolve_config
from dpo.config_file import load_config_file
from dpo.losses import LossConfig, dpo_loss


def _yaml(tmp_path, data: dict):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _parsed(args: list[str]) -> dict:
    """click's values for a train-dpo command line, without running it."""
    params = main.make_context("train-dpo", [str(a) for a in args]).params
    return {k: v for k, v in params.items() if k not in ("config_file", "debug")}


def test_a_dpo_config_dump_loads_and_trains(tmp_path, llama_dir, dpo_data, dpo_cache):
    from trl import DPOConfig

    out = tmp_path / "out"
    dump = DPOConfig(output_dir=str(out), bf16=False, use_cpu=True, max_steps=1, per_device_train_batch_size=4,
                     logging_steps=1, beta=0.25, loss_type=["ipo"], precompute_ref_log_probs=True).to_dict()
    assert dump["hub_token"] == "<HUB_TOKEN>" and dump["debug"] == [] and dump["loss_weights"] is None
    recipe = _yaml(tmp_path, dump)
    cfg = resolve_config(recipe, {"model": str(llama_dir), "data": str(dpo_data), "ref_cache": str(dpo_cache)})
    assert "hub_token" not in cfg.training_args  # to_dict's placeholder is not a token
    assert cfg.training_arguments().hub_token is None
    result = CliRunner().invoke(main, ["--config", recipe, "--model_name_or_path", str(llama_dir),
                                       "--dataset_name", str(dpo_data), "--ref-cache", str(dpo_cache), "--no-plot"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "precompute_ref_log_probs: refcache's reference cache replaces this" in result.output
    assert "keys at TRL's default:" in result.output and "padding_free" in result.output
    manifest = json.loads((out / "run-manifest.json").read_text())
    assert manifest["config"]["beta"] == 0.25 and manifest["config"]["loss_type"] == "ipo"
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx((1 / (2 * 0.25)) ** 2, abs=1e-5)  # IPO at the reference: beta was used


def test_a_dump_with_a_setting_we_do_not_support_is_refused_naming_it(tmp_path):
    from trl import DPOConfig

    dump = DPOConfig(output_dir=str(tmp_path / "o"), bf16=False, use_cpu=True, use_weighting=True,
                     sync_ref_model=True).to_dict()
    with pytest.raises(click.UsageError, match=r"unknown option\(s\) sync_ref_model, use_weighting \("):
        load_config_file(_yaml(tmp_path, dump))


def test_trl_names_on_the_command_line_and_in_a_file(tmp_path):
    assert TRL_ALIASES["dtype"] == "model_dtype" and TRL_ALIASES["model_name_or_path"] == "model"
    given = _parsed(["--model_name_or_path", "org/sft", "--dataset-name", "org/prefs", "--output-dir", tmp_path,
                     "--dtype", "bfloat16", "--dataset_train_split", "eval"])
    cfg = resolve_config(None, given)
    assert (cfg.model, cfg.data, cfg.model_dtype, cfg.split) == (Path("org/sft"), Path("org/prefs"), "bfloat16", "eval")
    recipe = _yaml(tmp_path, {"model_name_or_path": "org/sft", "dataset_name": "org/prefs", "dtype": "float16",
                              "dataset_test_split": "validation", "output_dir": str(tmp_path)})
    cfg = resolve_config(recipe, _parsed(["--dtype", "bfloat16"]))  # the command line wins, under either name
    assert (cfg.model, cfg.model_dtype, cfg.eval_split) == (Path("org/sft"), "bfloat16", "validation")
    assert "--model, --model-name-or-path, --model_name_or_path" in CliRunner().invoke(main, ["--help"]).output


def test_trl_names_neighbours_a_conflict_and_a_bad_value_name_the_key(tmp_path):
    with pytest.raises(click.UsageError, match=r"line 2: model and model_name_or_path both give model \(line 1: 'a'; line 2: 'b'\)"):
        load_config_file(_yaml(tmp_path, {"model": "a", "model_name_or_path": "b"}))
    assert load_config_file(_yaml(tmp_path, {"model": "a", "model_name_or_path": "a"}))["model"] == Path("a")
    with pytest.raises(click.UsageError, match=r"dtype \(TRL's name of model_dtype\): 'auto' is not one of"):
        load_config_file(_yaml(tmp_path, {"dtype": "auto"}))
    result = CliRunner().invoke(main, ["--dtype", "auto"])
    assert result.exit_code == 2 and "'auto' is not one of" in result.output


def test_trl_rpo_is_refused_with_the_rpo_alpha_hint(tmp_path):
    recipe = _yaml(tmp_path, {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]})
    with pytest.raises(click.UsageError, match=r"TRL's RPO\) is not mapped.*loss_type: sigmoid and rpo_alpha: 0\.5"):
        load_config_file(recipe)
    # why it is not mapped: with chosen completions of different lengths TRL's sft term (the NLL averaged over every
    # chosen token of the batch) and refcache's (each pair's per-token mean, averaged over pairs) differ
    lengths = torch.tensor([1, 3, 2, 2])  # chosen 0, chosen 1, rejected 0, rejected 1
    policy = torch.tensor([-1.0, -2.0, -2.0, -2.0, -0.5, -0.5, -0.7, -0.7])
    ref = policy.clone()  # at the reference: the sigmoid term is ln 2 for every pair
    base, _ = dpo_loss(policy, ref, lengths, LossConfig())
    rpo, _ = dpo_loss(policy, ref, lengths, LossConfig(rpo_alpha=1.0))
    ours = (1.0 / 1 + 6.0 / 3) / 2  # per-pair means: 1.0 and 2.0
    trl = (1.0 + 6.0) / 4  # every chosen token alike
    assert float(rpo - base) == pytest.approx(ours) and ours != pytest.approx(trl)


def test_loss_lists_neighbours(tmp_path):
    assert load_config_file(_yaml(tmp_path, {"loss_type": ["ipo"], "loss_weights": [1.0]}))["loss_type"] == "ipo"
    with pytest.raises(click.UsageError, match=r"unknown option\(s\) loss_weights"):  # one loss, scaled
        load_config_file(_yaml(tmp_path, {"loss_type": ["ipo"], "loss_weights": [2.0]}))
    with pytest.raises(click.UsageError, match="refcache trains one preference loss"):
        load_config_file(_yaml(tmp_path, {"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0, 1.0]}))
    with pytest.raises(click.UsageError, match=r"rpo_alpha: 1 "):  # TRL's weights default to 1 each
        load_config_file(_yaml(tmp_path, {"loss_type": ["sft", "sigmoid"]}))
    # TRL 1.16's sigmoid ignores label_smoothing; refcache's is cDPO with it: a TRL recipe asking for both is refused
    with pytest.raises(click.UsageError, match=r"TRL 1\.16's sigmoid loss ignores label_smoothing"):
        load_config_file(_yaml(tmp_path, {"loss_type": ["sigmoid"], "label_smoothing": 0.1}))
    assert load_config_file(_yaml(tmp_path, {"loss_type": "sigmoid", "label_smoothing": 0.1}))["label_smoothing"] == 0.1
    assert load_config_file(_yaml(tmp_path, {"loss_type": ["robust"], "label_smoothing": 0.1}))["loss_type"] == "robust"


def test_ref_model_init_kwargs_is_the_ref_options_the_readme_maps_it_to(tmp_path):
    """README 'Coming from TRL': older TRL's ref_model_init_kwargs placed the reference (device_map, max_memory,
    offload_folder); in a --config they are --ref-device-map, --ref-max-memory, --ref-offload-folder, checked as those
    options are (a bad size names the key as given)."""
    kwargs = {"device_map": "auto", "max_memory": {0: "2GiB", "cpu": "3GiB"}, "offload_folder": str(tmp_path / "off")}
    values = load_config_file(_yaml(tmp_path, {"ref_model_init_kwargs": kwargs}))
    assert values == {"ref_device_map": "auto", "ref_max_memory": f"0={2 * 2**30},cpu={3 * 2**30}",
                      "ref_offload_folder": tmp_path / "off"}  # a path option: read by the location type
    assert load_config_file(_yaml(tmp_path, {"ref_model_init_kwargs": {"max_memory": "cpu=1GiB"}})) == {
        "ref_max_memory": f"cpu={2**30}"}
    assert load_config_file(_yaml(tmp_path, {"ref_model_init_kwargs": None, "beta": 0.2})) == {"beta": 0.2}
    assert load_config_file(_yaml(tmp_path, {"ref_model_init_kwargs": {}, "beta": 0.2})) == {"beta": 0.2}
    with pytest.raises(click.UsageError, match=r"ref_model_init_kwargs\.max_memory \(TRL's name of ref_max_memory\): "
                                               r"'lots' is not a memory size"):
        load_config_file(_yaml(tmp_path, {"ref_model_init_kwargs": {"max_memory": "lots"}}))
    cfg = resolve_config(_yaml(tmp_path, {"ref_model_init_kwargs": kwargs}),
                         _parsed(["--model", "m", "--data", "d", "--output-dir", tmp_path / "o"]))
    assert (cfg.ref_device_map, cfg.ref_offload_folder) == ("auto", tmp_path / "off")


@pytest.mark.parametrize("kwargs, message", [
    ({"device_map": {"": 0}}, r"ref_model_init_kwargs\.device_map \{'': 0\} names a device, not a splitting strategy"),
    ({"device_map": "cuda:0"}, r"device_map 'cuda:0' names a device.*auto, balanced"),
    ({"torch_dtype": "bfloat16", "device_map": "auto"}, r"ref_model_init_kwargs: torch_dtype: not mapped.*--bf16"),
    ("auto", r"ref_model_init_kwargs is str; expected a mapping"),
])
def test_ref_model_init_kwargs_that_do_not_map_are_refused_naming_them(tmp_path, kwargs, message):
    with pytest.raises(click.UsageError, match=message):
        load_config_file(_yaml(tmp_path, {"ref_model_init_kwargs": kwargs}))


def test_ref_model_init_kwargs_neighbours(tmp_path):
    with pytest.raises(click.UsageError, match=r"ref_model_init_kwargs\.device_map and ref_device_map are both given"):
        load_config_file(_yaml(tmp_path, {"ref_model_init_kwargs": {"device_map": "auto"},
                                          "ref_device_map": "sequential"}))
    # TRL 1.16's model_init_kwargs places the policy too: refused pointing at the reference's own keys
    with pytest.raises(click.UsageError, match=r"model_init_kwargs: TRL 1\.16 loads the policy and the reference"):
        load_config_file(_yaml(tmp_path, {"model_init_kwargs": {"device_map": "auto"}}))
    assert load_config_file(_yaml(tmp_path, {"model_init_kwargs": None, "beta": 0.3})) == {"beta": 0.3}
    # through the command itself: the mapped options reach the same checks (no live reference with a cache)
    recipe = _yaml(tmp_path, {"ref_model_init_kwargs": {"device_map": "auto"}})
    result = CliRunner().invoke(main, ["--config", recipe, "--model", "m", "--data", "d", "--ref-cache",
                                       str(tmp_path), "--output-dir", str(tmp_path / "o")])
    assert result.exit_code == 2 and "--ref-device-map: with --ref-cache no reference model" in result.output, (
        result.output)


def test_warmup_ratio_is_refused_naming_what_transformers_5_reads_instead(tmp_path):
    """Found by the UX pass: an older TRL config's `warmup_ratio: 0.1` was refused as unknown or misspelt; it is, in
    transformers 5, a warmup_steps below 1: the refusal says so, with the value to give."""
    with pytest.raises(click.UsageError, match=r"warmup_ratio: transformers 5 reads a ratio from warmup_steps .*give "
                                               r"warmup_steps: 0.1"):
        load_config_file(_yaml(tmp_path, {"warmup_ratio": 0.1}))
    assert load_config_file(_yaml(tmp_path, {"warmup_steps": 0.1}))["warmup_steps"] == 0.1
