"""train-dpo's KL options refused where they would be ignored or misread (issue 35, hostile pass): every KL option
is either a switch or in runtime/kl_control.py's READ_BY table, and each one given where nothing reads it is refused
(exit 2, naming it and what reads it), on the command line and in --config; --kl-target / --kl-alarm are checked by
their option type; a YAML config is read as YAML 1.2 (no base 60); a resume goes on under its checkpoint's β rule
or is refused naming the difference; a rollback never restores a checkpoint through a symbolic link."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from conftest import DATA
from dpo.cli import main
from runtime.config_file import yaml_12
from dpo.kl_governor import STATE_FILE, KLGovernor, check_resumed_rule
from dpo.config import TrainConfig
from runtime.errors import JobError
from runtime.kl_control import READ_BY, Settings, State, unread_options
from schemas import run_manifest as rm

SWITCHES = {"beta_schedule", "kl_target", "kl_alarm"}  # what turns governance on; every other KL option is read by one
KL_OPTIONS = {f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("group") == "KL control"}
# a value of each option other than its default, and options that make it read
GIVEN = {"beta_end": ("0.01", ["--beta-schedule", "linear"]), "kl_controller": ("proportional", ["--kl-target", "0.1"]),
         "kl_adapt_every": ("3", ["--kl-target", "0.1:0.2"]), "kl_control": ("kl_coef", ["--kl-target", "0.1:0.2"]),
         "kl_adapt_factor": ("1.5", ["--kl-alarm", "0.5:rollback"]),
         "kl_horizon": ("500", ["--kl-target", "0.1", "--kl-controller", "proportional"]),
         "beta_min": ("0.01", ["--kl-target", "0.1:0.2"]), "beta_max": ("0.4", ["--kl-target", "0.1:0.2"]),
         "kl_measure": ("both", ["--kl-alarm", "0.5"]), "kl_alarm_retries": ("3", ["--kl-alarm", "0.5:rollback"])}


def test_every_kl_option_is_a_switch_or_says_what_reads_it():
    assert KL_OPTIONS == SWITCHES | set(READ_BY), KL_OPTIONS ^ (SWITCHES | set(READ_BY))
    assert set(GIVEN) == set(READ_BY)  # the command-line cases below cover the whole table


def train_dpo(tmp_path, *args):
    """train-dpo in-process as typed, up to its refusals of the options (nothing is trained: a refusal exits 2
    before any model library is imported; the cases that pass are stopped by the missing cache)."""
    argv = ["--model", str(DATA / "sft-model"), "--data", str(DATA / "prefs"), "--ref-cache", str(tmp_path / "none"),
            "--output-dir", str(tmp_path / "out"), *args]
    return CliRunner().invoke(main, argv, catch_exceptions=False)


@pytest.mark.parametrize("name", sorted(READ_BY))
def test_a_kl_option_nothing_reads_is_refused_on_the_command_line_and_in_a_config(tmp_path, name):
    value, readers = GIVEN[name]
    flag = "--" + name.replace("_", "-")
    alone = train_dpo(tmp_path, flag, value)
    assert alone.exit_code == 2, alone.output
    assert f"{flag} " in alone.output and f"only {READ_BY[name][0]} reads it" in alone.output
    config = tmp_path / "run.yaml"
    config.write_text(f"{name}: {value}\n")
    in_file = train_dpo(tmp_path, "--config", str(config))
    assert in_file.exit_code == 2 and f"{config}: {name} " in in_file.output, in_file.output
    assert unread_options({name: value} | _as_fields(readers), [name]) == []  # and with what reads it, it is read


def _as_fields(args: list[str]) -> dict:
    return {a[2:].replace("-", "_"): v for a, v in zip(args[::2], args[1::2])}


@pytest.mark.parametrize("args, says", [
    (["--kl-target", "nan:1"], "Invalid value for '--kl-target'"),
    (["--kl-target", "0.1:inf"], "each a finite KL > 0"),
    (["--kl-target", "-1"], "each a finite KL > 0"),
    (["--kl-target", "1:2:3"], "give LO:HI"),
    (["--kl-alarm", "nan"], "Invalid value for '--kl-alarm'"),
    (["--kl-alarm", "0.5:explode"], "the action must be one of warn, checkpoint, stop, rollback"),
    (["--kl-alarm", ":stop"], "LEVEL must be a number"),
    (["--kl-alarm", "0.5:"], "the action must be one of warn, checkpoint, stop, rollback"),
])
def test_malformed_kl_target_and_alarm_are_usage_errors(tmp_path, args, says):
    r = train_dpo(tmp_path, *args)
    assert r.exit_code == 2 and says in r.output, r.output
    assert "unexpected" not in r.output


def test_a_yaml_config_is_read_as_yaml_1_2_never_base_60(tmp_path):
    assert yaml_12("kl_target: 1:2\nkl_alarm: 0.5:stop\nwarmup_steps: 010\nlearning_rate: 5e-7\nbf16: on\n") == {
        "kl_target": "1:2", "kl_alarm": "0.5:stop", "warmup_steps": 10, "learning_rate": 5e-7, "bf16": "on"}
    config = tmp_path / "run.yaml"
    config.write_text("kl_target: 1:2\nkl_adapt_every: 1:30\n")  # YAML 1.1 reads 62 and 90
    r = train_dpo(tmp_path, "--config", str(config))
    assert r.exit_code == 2 and f"{config}: kl_adapt_every" in r.output and "'1:30'" in r.output, r.output


# ---------------------------------------------------------------------------------------------------------------
# a resume goes on under the checkpoint's β rule

BAND = Settings(start=0.1, controller="band", low=0.001, high=0.002, total=8, warmup=1)


def checkpoint(tmp_path, settings: Settings | None, name="checkpoint-2", run_id="r" * 32):
    folder = tmp_path / "out" / name
    folder.mkdir(parents=True)
    (folder / rm.CHECKPOINT_RECORD).write_text(json.dumps({"run_id": run_id}))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": int(name.split("-")[1])}))
    if settings is not None:
        (folder / STATE_FILE).write_text(json.dumps({"run_id": run_id, "settings": settings.to_json(),
                                                     "state": State(value=0.12).to_json(), "events": []}))
    return folder


def test_a_resume_under_the_same_rule_goes_on_from_its_state(tmp_path):
    folder = checkpoint(tmp_path, BAND)
    # the total and warm-up are the Trainer's, resolved when training starts: not part of the comparison
    saved = check_resumed_rule(folder, dataclasses.replace(BAND, total=0, warmup=0))
    assert saved["state"]["value"] == 0.12
    assert check_resumed_rule(checkpoint(tmp_path, None, "checkpoint-4"), None) is None


@pytest.mark.parametrize("change, option", [
    (dict(high=0.003), "--kl-target"), (dict(start=0.2), "--beta / --kl-coef"), (dict(every=5), "--kl-adapt-every"),
    (dict(factor=1.5), "--kl-adapt-factor"), (dict(vmax=0.4), "--beta-max"), (dict(measure="both"), "--kl-measure"),
    (dict(alarm_level=0.5), "--kl-alarm"), (dict(controller="proportional", low=None, high=None, target=0.1,
                                               horizon=100.0), "--kl-controller"),
])
def test_a_resume_under_another_rule_is_refused_naming_the_option(tmp_path, change, option):
    folder = checkpoint(tmp_path, BAND)
    with pytest.raises(JobError) as refused:
        check_resumed_rule(folder, dataclasses.replace(BAND, **change))
    text = str(refused.value)
    assert f"the β rule differs in {option}" in text.splitlines()[0] or option in text.splitlines()[0]
    assert "the checkpoint: --beta 0.1 --kl-target 0.001:0.002" in text and "this run:" in text


def test_a_resume_that_drops_or_adds_a_rule_or_finds_it_damaged_is_refused(tmp_path):
    with pytest.raises(JobError, match="trained under a β rule .*this run has a fixed β"):
        check_resumed_rule(checkpoint(tmp_path, BAND), None)
    with pytest.raises(JobError, match="trained with a fixed β .*this run sets β by a rule"):
        check_resumed_rule(checkpoint(tmp_path, None, "checkpoint-4"), BAND)
    damaged = checkpoint(tmp_path, BAND, "checkpoint-6")
    (damaged / STATE_FILE).write_text('{"run_id": "r", "settings": ')
    with pytest.raises(JobError, match="is damaged"):
        check_resumed_rule(damaged, BAND)
    (damaged / STATE_FILE).write_text(json.dumps({"settings": {"start": 0.1, "bogus": 1}, "state": {"value": 1}}))
    with pytest.raises(JobError, match="is damaged"):
        check_resumed_rule(damaged, BAND)
    for text in ("[1, 2]", "7", json.dumps({"settings": {**BAND.to_json(), "every": 0}, "state": {"value": 1}}),
                 json.dumps({"settings": {**BAND.to_json(), "controller": "pid"}, "state": {"value": 1}})):
        (damaged / STATE_FILE).write_text(text)
        with pytest.raises(JobError, match="is damaged"):
            check_resumed_rule(damaged, BAND)


def test_a_rollback_never_restores_a_checkpoint_through_a_symbolic_link(tmp_path):
    run_id = "r" * 32
    settings = dataclasses.replace(BAND, alarm_level=0.5, alarm_action="rollback")
    real = checkpoint(tmp_path, settings, "checkpoint-2", run_id)
    elsewhere = checkpoint(tmp_path / "other", settings, "checkpoint-4", run_id)  # a copy of ours, outside the run
    out = real.parent
    (out / "checkpoint-4").symlink_to(elsewhere, target_is_directory=True)
    governor = KLGovernor(settings, out, run_id=run_id)
    governor.rule.state.checkpoint_kls = {"2": 0.1, "4": 0.1}
    assert governor._rollback_target() == (2, real)
    (out / "checkpoint-2" / STATE_FILE).unlink()
    (out / "checkpoint-2" / STATE_FILE).symlink_to(elsewhere / STATE_FILE)
    assert governor._rollback_target() is None
