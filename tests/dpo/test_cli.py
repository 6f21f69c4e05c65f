"""dpo/cli.py: train-dpo's options (every TrainingArguments field in both spellings, grouped help), config files
(YAML, JSON, TRL's DPOConfig YAML; the command line wins; unknown keys and wrong types are usage errors), the
summary line and --bf16."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import step_records
from dpo.cli import main

TRAIN = ["--use-cpu", "--max-steps", "1", "--per-device-train-batch-size", "4", "--logging-steps", "1", "--no-plot"]


# ---------------------------------------------------------------------------------------------------------------
# --config files


def _cli(args: list[str]):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_yaml_config_sets_options_and_the_command_line_overrides(tmp_path, llama_dir, dpo_data, dpo_cache):
    cfg = tmp_path / "run.yaml"
    # IPO's first-step loss with the policy at the reference is (1/(2 beta))^2, so it shows which beta was used.
    # 1e-3 is how people write it; YAML 1.1 reads it as a string.
    cfg.write_text("loss_type: ipo\nbeta: 0.25\nmax_steps: 2\nlearning_rate: 1e-3\nuse_cpu: true\n"
                   "per_device_train_batch_size: 4\nlogging_steps: 1\nplot: false\nseed: 7\n")
    out = tmp_path / "out"
    result = _cli(["--config", cfg, "--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache,
                   "--output-dir", out, "--max-steps", 3])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "run-manifest.json").read_text())
    assert manifest["config"]["max_steps"] == 3  # command line beats the file
    assert manifest["config"]["beta"] == 0.25 and manifest["config"]["loss_type"] == "ipo"
    assert manifest["config"]["learning_rate"] == 1e-3
    steps = step_records(out)
    assert sorted(steps) == [1, 2, 3]
    assert steps[1]["loss"] == pytest.approx((1 / (2 * 0.25)) ** 2, abs=1e-5)
    assert steps[1]["learning_rate"] == pytest.approx(1e-3)


def test_json_config_with_kebab_keys_and_override(tmp_path, llama_dir, dpo_data, dpo_cache):
    out = tmp_path / "out"
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({
        "model": str(llama_dir), "data": str(dpo_data), "ref-cache": str(dpo_cache), "output-dir": str(out),
        "loss-type": "ipo", "beta": 0.5, "max-steps": 2, "use-cpu": True, "logging-steps": 1, "plot": False,
        "per-device-train-batch-size": 4,
    }))
    result = _cli(["--config", cfg, "--beta", 1.0])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "run-manifest.json").read_text())
    assert manifest["config"]["beta"] == 1.0 and manifest["config"]["max_steps"] == 2
    steps = step_records(out)
    assert sorted(steps) == [1, 2]
    assert steps[1]["loss"] == pytest.approx((1 / (2 * 1.0)) ** 2, abs=1e-5)


@pytest.mark.parametrize("suffix,text", [(".yaml", "max_step: 3\nbeta: 0.2\n"), (".json", '{"betta": 0.2}')])
def test_unknown_config_key_is_a_usage_error(tmp_path, llama_dir, dpo_data, dpo_cache, suffix, text):
    cfg = tmp_path / f"run{suffix}"
    cfg.write_text(text)
    out = tmp_path / "out"
    result = _cli(["--config", cfg, "--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache,
                   "--output-dir", out])
    assert result.exit_code == 2
    assert "unknown option(s)" in result.output and ("max_step" in result.output or "betta" in result.output)
    assert not out.exists()


def test_config_value_of_the_wrong_type_is_a_usage_error(tmp_path, llama_dir, dpo_data, dpo_cache):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("max_steps: many\n")
    result = _cli(["--config", cfg, "--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache,
                   "--output-dir", tmp_path / "out"])
    assert result.exit_code == 2
    assert "max_steps" in result.output and "many" in result.output
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------
# issue 16 (what a TRL user expects), item 4: the summary states one accuracy, named (no kl_k3: test_losses.py)


def test_summary_names_one_accuracy():
    from dpo.cli import summary_text

    text = summary_text({"eval": {"eval_rewards/accuracies": 0.75}, "output_dir": "o", "steps": 3, "train_s": 1.0,
                         "verify_s": 0.1, "train_loss": 0.5, "eval_start": {"eval_logps/accuracies": 0.4}})
    assert "eval reward accuracy 0.750" in text and "0.400" not in text and "preferred" not in text


def test_summary_says_only_what_happened(tmp_path):
    """Issue 25 item 11: no verification figure with a live reference (nothing was verified), no plot line when no
    plot was written (--no-plot); both where they were."""
    from dpo.cli import summary_text

    run = {"eval": {}, "output_dir": str(tmp_path), "steps": 3, "train_s": 1.0, "verify_s": 0.1, "train_loss": 0.5}
    live = summary_text({**run, "reference": "live"})
    assert "verification" not in live and "plot:" not in live and "manifest:" in live and "card:" not in live
    (tmp_path / "metrics.png").write_bytes(b"\x89PNG")
    (tmp_path / "README.md").write_text("---\ntags: [refcache]\n---\n")
    cached = summary_text({**run, "reference": "cache"})
    assert "(verification 0.1 s)" in cached and f"plot:       {tmp_path / 'metrics.png'}" in cached
    assert f"card:       {tmp_path / 'README.md'}" in cached  # the model card, where one was written


def _summary_loss(output: str) -> float:
    return float(output.split("train loss ")[1].split()[0].rstrip(";"))


def test_summary_train_loss_after_a_resume_is_the_whole_runs(tmp_path, llama_dir, dpo_data, dpo_cache):
    """Issue 25 item 11: resumed at step 3 of 6, the summary's (and the manifest's) train loss is the mean over all 6
    steps, not the Trainer's mean over the 3 resumed ones."""
    import shutil

    run = ["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--max-steps", 6, "--save-steps", 3,
           "--use-cpu", "--learning-rate", 1e-3, "--per-device-train-batch-size", 4, "--logging-steps", 1,
           "--seed", 7, "--no-plot"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    whole = _cli([*run, "--output-dir", full])
    assert whole.exit_code == 0, whole.output
    losses = {step: r["loss"] for step, r in step_records(full).items()}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and len(set(losses.values())) == 6
    resumed.mkdir()  # a copy of the run up to checkpoint-3 (its record, metrics and checkpoint)
    shutil.copy(full / "refcache-run.json", resumed)
    shutil.copytree(full / "checkpoint-3", resumed / "checkpoint-3")
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in map(json.loads, (
        full / "metrics.jsonl").read_text().splitlines()) if r["step"] <= 3))
    result = _cli([*run, "--output-dir", resumed, "--resume-from-checkpoint", resumed / "checkpoint-3"])
    assert result.exit_code == 0, result.output
    mean = sum(losses.values()) / 6
    assert _summary_loss(result.output) == pytest.approx(mean, abs=1e-4)
    assert _summary_loss(result.output) != pytest.approx(sum(losses[s] for s in (4, 5, 6)) / 3, abs=1e-4)
    assert "(all 6 steps; resumed at step 3)" in result.output
    assert json.loads((resumed / "run-manifest.json").read_text())["result"]["train_loss"] == pytest.approx(mean,
                                                                                                         abs=1e-6)
    assert _summary_loss(whole.output) == pytest.approx(mean, abs=1e-4) and "resumed" not in whole.output


def test_whole_run_train_loss_counts_each_logged_loss_for_the_steps_it_covers():
    """Logged every 2 steps (and at step 1): the record at step 4 is the mean of steps 3 and 4, so it counts twice;
    a record after the resumed step (logged again by the resumed run) does not count."""
    from dpo.run_summary import whole_run_train_loss

    records = [{"step": 1, "loss": 0.7}, {"step": 2, "loss": 0.6}, {"step": 2, "eval_loss": 0.1},
               {"step": 4, "loss": 0.5}, {"step": 6, "loss": 9.0}]
    # resumed at step 4 of 10: the Trainer's own mean over steps 5..10 is 0.3
    assert whole_run_train_loss(records, 4, 0.3, 10) == pytest.approx((0.7 + 0.6 + 2 * 0.5 + 6 * 0.3) / 10)
    # resumed at step 5 (not a logging step): step 5 was never logged, so it is left out
    assert whole_run_train_loss(records, 5, 0.3, 10) == pytest.approx((0.7 + 0.6 + 2 * 0.5 + 5 * 0.3) / 9)


def test_summary_names_the_checkpoint_load_best_model_at_end_kept(tmp_path, llama_dir, dpo_data, dpo_cache):
    """Issue 25 item 11: with --load-best-model-at-end the summary says whose weights the output holds, as the
    Trainer's own state (trainer_state.json of the last checkpoint) records it."""
    out = tmp_path / "out"
    result = _cli(["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, "--output-dir", out,
                   "--eval-data", dpo_data, "--eval-split", "train", "--eval-ref-cache", dpo_cache,
                   "--eval-strategy", "steps", "--eval-steps", 2, "--save-steps", 2, "--max-steps", 4,
                   "--load-best-model-at-end", "--metric-for-best-model", "rewards/margins", "--use-cpu", *TRAIN[3:]])
    assert result.exit_code == 0, result.output
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    best = Path(state["best_model_checkpoint"]).name
    assert (f"(--load-best-model-at-end: the weights of {best}, best eval_rewards/margins "
            f"{state['best_metric']:.4f})") in result.output
    without = summary_text_of(tmp_path)
    assert "load-best-model-at-end" not in without


def summary_text_of(tmp_path, **keys) -> str:
    from dpo.cli import summary_text

    return summary_text({"eval": {}, "output_dir": str(tmp_path), "steps": 3, "train_s": 1.0, "verify_s": 0.1,
                         "train_loss": 0.5, **keys})


def test_summary_lists_the_merged_model_and_notes_a_cache_of_another_precision(tmp_path):
    """Issue 25 item 11: merged/ listed when written; a bfloat16 cache under a float32 policy: the step-1 loss is
    not ln 2, said once, with the figure (and with the log-ratio where the loss has no data-free value)."""
    merged = tmp_path / "merged"
    assert f"\n  merged:     {merged}\n" in summary_text_of(tmp_path, merged_dir=str(merged))
    assert "merged:" not in summary_text_of(tmp_path, merged_dir=None)
    note = {"cache_dtype": "bfloat16", "policy_dtype": "float32", "step_1_loss": 0.6952, "loss_at_reference":
            math.log(2), "step_1_logratio": 3e-3}
    text = summary_text_of(tmp_path, precision=note)
    assert text.count("note:") == 1
    assert ("note: the cache's reference log-probs are bfloat16 and the policy computes in float32, so they differ "
            "by rounding even where the policy is the reference: step 1's loss is 0.695200, not 0.693147 = ln 2"
            ) in text
    rpo = summary_text_of(tmp_path, precision=note | {"loss_at_reference": None})
    assert "step 1's mean per-token log-ratio 3.00e-03, not 0" in rpo
    assert "note:" not in summary_text_of(tmp_path, precision=None)


def test_a_bfloat16_cache_under_a_float32_policy_is_noted_with_the_step_1_loss(tmp_path, llama_dir, dpo_data):
    from precompute.job import PrecomputeConfig, run_precompute

    cache = tmp_path / "bf16-cache"
    run_precompute(PrecomputeConfig(model=str(llama_dir), data=str(dpo_data), out=str(cache), dtype="bfloat16",
                                    progress=False), log=lambda m: None)
    out = tmp_path / "out"
    result = _cli(["--model", llama_dir, "--data", dpo_data, "--ref-cache", cache, "--output-dir", out, *TRAIN])
    assert result.exit_code == 0, result.output
    first = step_records(out)[1]["loss"]
    assert abs(first - math.log(2)) > 1e-6  # the rounding shows
    assert (f"note: the cache's reference log-probs are bfloat16 and the policy computes in float32, so they differ "
            f"by rounding even where the policy is the reference: step 1's loss is {first:.6f}, not 0.693147 = ln 2"
            ) in result.output


def test_help_has_no_argparse_escapes():
    """Issue 25 item 11: transformers' help texts escape % as %% for argparse; --help shows a plain %."""
    from click.testing import CliRunner

    from dpo.cli import main

    text = CliRunner().invoke(main, ["--help"]).output
    assert "%%" not in text and "~20% slower" in " ".join(text.split())


# issue 16 (what a TRL user expects), item 5: options: every TrainingArguments field, both spellings, grouped help, DPOConfig YAML, resume true


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

    from dpo.config_file import load_config_file

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
    assert values["model"] == Path("org/sft") and values["data"] == Path("org/prefs")  # hub ids, read as places
    assert "precompute_ref_log_probs" not in values  # at TRL's default: changes nothing, ignored with a note
    data["padding_free"] = True  # a DPOConfig key we do not support, set away from its default
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(Exception, match="unknown option\\(s\\) padding_free"):
        load_config_file(str(path))
    assert "padding_free" in keys


# issue 16 (what a TRL user expects), item 14: --bf16 is autocast over float32 master weights; --bf16 on CPU names --use-cpu


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


# ---------------------------------------------------------------------------------------------------------------
# issue 25 (TRL recipes), item 4: --columns on precompute-ref is recorded in the cache's encoding; train-dpo and
# audit-ref --data take it from there, and a train-dpo --columns that differs is refused


def test_columns_travel_with_the_cache(tmp_path, llama_dir):
    from conftest import audit_ref, precompute_cli, pref_rows, statuses, write_jsonl

    names = {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}
    rows = [{names.get(k, k): v for k, v in r.items()} for r in pref_rows(8, fmt="conversational")]
    data, cache, out = write_jsonl(tmp_path / "se.jsonl", rows), tmp_path / "cache", tmp_path / "out"
    result = precompute_cli("--model", llama_dir, "--data", data, "--out", cache,
                        "--columns", "rejected=response_k,prompt=question,chosen=response_j")
    assert result.exit_code == 0, result.output
    encoding = json.loads((cache / "manifest.json").read_text())["encoding"]
    assert encoding["columns"] == "prompt=question,chosen=response_j,rejected=response_k"
    base = ["--model", llama_dir, "--data", data, "--ref-cache", cache, *TRAIN]
    refused = _cli([*base, "--output-dir", out, "--columns", "prompt=question,chosen=response_k,rejected=response_j"])
    assert refused.exit_code == 2 and not out.exists()
    assert "--columns prompt=question,chosen=response_k,rejected=response_j conflicts with" in refused.output
    trained = _cli([*base, "--output-dir", out])  # no --columns: the cache's
    assert trained.exit_code == 0, trained.output
    first = step_records(out)[1]
    assert first["loss"] == pytest.approx(0.6931, abs=1e-3)  # at the reference: the cached values are these rows'
    code, report, output = audit_ref(cache, "--model", llama_dir, "--data", data)
    assert code == 0 and statuses(report)["data_rows"] == "PASS", output
    live = _cli(["--model", llama_dir, "--data", data, "--ref-model", llama_dir, *TRAIN, "--output-dir",
                 tmp_path / "live", "--columns", "prompt=question,chosen=response_j,rejected=response_k"])
    assert live.exit_code == 0, live.output  # without a cache, --columns is the encoding
    assert step_records(tmp_path / "live")[1]["loss"] == pytest.approx(first["loss"], abs=1e-5)


def test_columns_neighbours_a_bad_mapping_is_a_usage_error_and_a_missing_column_names_the_file(tmp_path, llama_dir):
    from conftest import precompute_cli, pref_rows, write_jsonl

    data = write_jsonl(tmp_path / "prefs.jsonl", pref_rows(4))
    twice = precompute_cli("--model", llama_dir, "--data", data, "--out", tmp_path / "c1", "--columns",
                       "prompt=a,prompt=b")
    assert twice.exit_code == 2 and "prompt is mapped twice (prompt=a, prompt=b)" in twice.output
    assert "--columns" in twice.output
    missing = precompute_cli("--model", llama_dir, "--data", data, "--out", tmp_path / "c2", "--columns",
                         "prompt=question")
    assert missing.exit_code == 2 and f"{data}: no column 'question' (--columns prompt=question)" in missing.output
    assert not (tmp_path / "c2" / "manifest.json").exists()
    cfg = tmp_path / "run.yaml"
    cfg.write_text("columns: {chosen: b, prompt: a}\n")
    from dpo.config_file import load_config_file

    assert load_config_file(str(cfg))["columns"] == "prompt=a,chosen=b"
    cfg.write_text("columns: prompt=a,chosen=a\n")
    with pytest.raises(Exception, match=r"run\.yaml: columns: column 'a' is mapped twice"):
        load_config_file(str(cfg))


# ---------------------------------------------------------------------------------------------------------------
# --ref-device-map / --ref-max-memory / --ref-offload-folder: refused where no live reference model of its own is
# loaded, and where precompute-ref's own would be (runtime/placement.py); before anything is written


@pytest.mark.parametrize("options, message", [
    (["--ref-cache", "{cache}", "--ref-device-map", "auto"], "--ref-device-map: with --ref-cache no reference model "
                                                             "is loaded"),
    (["--ref-model", "{model}", "--use-peft", "--ref-device-map", "auto", "--ref-max-memory", "1GiB"],
     "--ref-device-map, --ref-max-memory with --use-peft: the live reference is the policy itself"),
    (["--ref-model", "{model}", "--ref-max-memory", "1GiB"], "--ref-max-memory place a model split by "
                                                             "--ref-device-map; add --ref-device-map auto"),
    (["--ref-model", "{model}", "--ref-offload-folder", "{tmp}/off"], "add --ref-device-map auto"),
    (["--ref-model", "{model}", "--ref-device-map", "auto", "--ref-max-memory", "lots"],
     "'--ref-max-memory' / '--ref_max_memory': 'lots' is not a memory size"),
    (["--ref-model", "{model}", "--ref-device-map", "auto", "--ref-offload-folder", "{out}/offload"],
     "--ref-offload-folder {out}/offload is inside --output-dir"),
    (["--ref-model", "{model}", "--ref-device-map", "auto", "--ref-offload-folder", "{model}/offload"],
     "is inside --model"),
    (["--ref-model", "{model}", "--ref-device-map", "auto", "--ref-max-memory", "99=1GiB,cpu=1GiB"],
     "--ref-max-memory 99=1073741824,cpu=1073741824 names GPU 99, and this machine has"),
])
def test_a_live_reference_split_is_refused_where_it_does_not_apply(tmp_path, llama_dir, dpo_data, dpo_cache, options,
                                                                   message):
    out = tmp_path / "out"
    fill = lambda s: s.format(tmp=tmp_path, out=out, model=llama_dir, cache=dpo_cache)
    before = sorted(p.name for p in llama_dir.iterdir())
    result = _cli(["--model", llama_dir, "--data", dpo_data, "--output-dir", out, *TRAIN, *map(fill, options)])
    assert result.exit_code == 2, result.output
    assert fill(message) in " ".join(result.output.split()), result.output
    assert not out.exists() and not (tmp_path / "off").exists()
    assert sorted(p.name for p in llama_dir.iterdir()) == before  # nothing written anywhere


def test_a_live_reference_split_under_torchrun_is_refused(tmp_path, llama_dir, dpo_data, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    from dpo.preflight import check_reference_split
    from dpo.config import TrainConfig
    from runtime.errors import JobError

    cfg = TrainConfig(model=str(llama_dir), data=str(dpo_data), output_dir=str(tmp_path / "out"),
                      ref_model=str(llama_dir), ref_device_map="auto")
    with pytest.raises(JobError, match="--ref-device-map auto splits one model over this process's devices, and this "
                                       "job runs 2 processes"):
        check_reference_split(cfg)


def test_the_resume_command_after_ctrl_c_writes_whole_numbers_as_integers(tmp_path):
    """`--save-steps 50 --logging-steps 10` (float options of TrainingArguments) come back as typed, not 50.0."""
    import shlex

    from dpo.cli import next_step, resolve_config
    from schemas import run_manifest as rm

    out = tmp_path / "run"
    (out / "checkpoint-50").mkdir(parents=True)
    rm.write_json(out / rm.RUN_RECORD, rm.run_record("d" * 32, "2026-01-01T00:00:00+00:00"))
    (out / "checkpoint-50" / "trainer_state.json").write_text('{"global_step": 50}')
    (out / "checkpoint-50" / rm.CHECKPOINT_RECORD).write_text(json.dumps({"run_id": "d" * 32}))
    ctx = main.make_context("train-dpo", ["--model", "m", "--data", "d.jsonl", "--output-dir", str(out),
                                          "--save-steps", "50", "--logging-steps", "10", "--learning-rate", "5e-7",
                                          "--beta", "0.5"])
    given = {k: v for k, v in ctx.params.items() if k not in ("config_file", "debug")}
    assert isinstance(given["save_steps"], float)  # what click hands over
    cfg = resolve_config(None, given)
    cfg.run_id = "d" * 32
    words = shlex.split(next_step(cfg, None, given).splitlines()[-1])
    assert words[words.index("--save-steps") + 1] == "50" and words[words.index("--logging-steps") + 1] == "10"
    assert float(words[words.index("--learning-rate") + 1]) == 5e-7 and words[words.index("--beta") + 1] == "0.5"


def test_the_summary_writes_each_path_as_a_shell_takes_it_back(tmp_path):
    """A folder name with a space (UX pass): every path line of train-dpo's summary is quoted the way precompute-ref's
    summary and every printed command are (runtime.cli.shell_word)."""
    import shlex

    from dpo.cli import summary_text

    out = tmp_path / "my runs" / "r1"
    out.mkdir(parents=True)
    (out / "metrics.png").write_bytes(b"\x89PNG")
    text = summary_text({"eval": {}, "output_dir": str(out), "steps": 1, "train_s": 1.0, "verify_s": 0.1,
                         "train_loss": 0.5, "merged_dir": str(out / "merged")})
    for label, path in (("checkpoint", out), ("metrics", out / "metrics.jsonl"), ("plot", out / "metrics.png"),
                        ("manifest", out / "run-manifest.json"), ("merged", out / "merged")):
        line = next(x for x in text.splitlines() if x.strip().startswith(label + ":"))
        assert shlex.split(line.split(":", 1)[1])[0] == str(path), line
