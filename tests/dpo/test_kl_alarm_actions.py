"""train-dpo's KL governor end to end on data/ with a top-k cache (issue 35's acceptance), the cases
test_kl_governor.py leaves: a band above the run's KL lowers β by exactly the factor per interval to its clamp, and a
run SIGKILLed after a checkpoint resumes to the uninterrupted run (β exactly, losses within 1e-6); the alarm's warn,
checkpoint and stop actions on a learning rate that makes the KL run away, each recorded once in metrics.jsonl, the
run manifest and the console, stop ending the process with its own exit code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from conftest import DATA, HELPERS, records
from dpo.cli import main as train_dpo
from dpo.config import TrainConfig
from dpo.recipe import run_train
from dpo.kl_governor import EXIT_KL_ALARM

MODEL = DATA / "sft-model"
STEPS = 6


# one table of options, written once as TrainConfig keywords and once as the command line a user types
BASE = dict(per_device_train_batch_size=4, max_steps=STEPS, logging_steps=1, save_steps=2, plot=False, seed=1,
            use_cpu=True)


def options(kl_pairs, out, **extra) -> dict:
    data, cache = kl_pairs
    return dict(model=str(MODEL), data=str(data), ref_cache=str(cache), output_dir=str(out)) | BASE | extra


def command_line(opts: dict) -> list[str]:
    args = []
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + key.replace("_", "-"))
        else:
            args += [flag, str(value)]
    return args


def losses(out) -> dict[int, dict]:
    return {r["step"]: r for r in records(out) if "loss" in r}


def events(out, kind=None) -> list[dict]:
    return [r for r in records(out) if r.get("event") and (kind is None or r["event"] == kind)]


def test_a_band_above_the_kl_lowers_beta_to_its_clamp_and_a_run_killed_after_a_checkpoint_resumes_to_it(
        kl_pairs, tmp_path):
    band = dict(kl_target="1:2", kl_adapt_every=2, beta=0.1, beta_min=0.08, learning_rate=5e-7)
    whole = tmp_path / "whole"
    run_train(TrainConfig(**options(kl_pairs, whole, **band)), log=lambda m: None)
    decisions = events(whole, "kl_control")
    assert [d["step"] for d in decisions] == [2, 4, 6]
    assert [d["after"] for d in decisions] == [0.1 / 1.2, 0.08, 0.08]  # exactly /1.2, then the clamp holds
    assert [d["action"] for d in decisions] == ["lower", "lower", "lower"]
    assert {s: r["beta"] for s, r in losses(whole).items()} == {1: 0.1, 2: 0.1, 3: 0.1 / 1.2, 4: 0.1 / 1.2,
                                                               5: 0.08, 6: 0.08}

    # the same run as a real process, SIGKILLed once checkpoint-4 is saved, then resumed by the command a user types
    killed = tmp_path / "killed"
    env = {**os.environ, "FAULT_AT": "checkpoint", "FAULT_STEP": "4"}
    proc = subprocess.run([sys.executable, str(HELPERS / "fault_launcher.py"), "train-dpo",
                           *command_line(options(kl_pairs, killed, **band))], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (killed / "checkpoint-4" / "kl-control.json").is_file() and not (killed / "run-manifest.json").exists()
    resumed = CliRunner().invoke(train_dpo, command_line(options(kl_pairs, killed, **band))
                                 + ["--resume-from-checkpoint", str(killed / "checkpoint-4")], catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    assert {s: r["beta"] for s, r in losses(killed).items()} == {s: r["beta"] for s, r in losses(whole).items()}
    for step, r in losses(whole).items():
        assert abs(losses(killed)[step]["loss"] - r["loss"]) <= 1e-6, step
    assert events(killed) == events(whole)
    assert json.loads((killed / "run-manifest.json").read_text())["kl_control"]["final"] == 0.08


@pytest.fixture(scope="module")
def runaway(kl_pairs, tmp_path_factory):
    """lr 1e-4 makes the KL per step rise (about 2e-4, 7e-4, 1e-3, 3e-3 at steps 2-5): an alarm at 5e-4 fires from
    step 3 on. One run per action, warn and checkpoint in process, stop through the command line."""
    base = tmp_path_factory.mktemp("runaway")
    runs = {}
    for action in ("warn", "checkpoint"):
        lines = []
        out = base / action
        run_train(TrainConfig(**options(kl_pairs, out, learning_rate=1e-4, save_steps=100,
                                        kl_alarm=f"5e-4:{action}")), log=lines.append)
        runs[action] = out, lines
    out = base / "stop"
    result = CliRunner().invoke(train_dpo, command_line(options(kl_pairs, out, learning_rate=1e-4, save_steps=100,
                                                                kl_alarm="5e-4:stop")))
    runs["stop"] = out, result
    return runs


@pytest.mark.parametrize("action", ["warn", "checkpoint"])
def test_a_warning_or_checkpoint_alarm_acts_once_per_firing_and_the_run_goes_on(runaway, action):
    out, lines = runaway[action]
    alarms = events(out, "kl_alarm")
    assert alarms and all(a["action"] == action and a["kl"] > 5e-4 and a["level"] == 5e-4 for a in alarms)
    fired = [a["step"] for a in alarms]
    assert len(set(fired)) == len(fired)  # once each
    for a in alarms:  # each firing is the logged KL of its step over the level
        assert losses(out)[a["step"]]["kl/measured"] == pytest.approx(a["kl"], rel=1e-12)
    assert sorted(losses(out)) == list(range(1, STEPS + 1))  # trained on to the end
    manifest = json.loads((out / "run-manifest.json").read_text())
    assert manifest["kl_control"]["alarms"] == alarms
    console = [line for line in lines if "KL alarm at step" in line]
    assert [int(line.split("KL alarm at step ")[1].split(":")[0]) for line in console] == fired
    checkpoints = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    if action == "checkpoint":  # save_steps 100: every checkpoint there is one an alarm asked for
        assert set(fired) - {STEPS} <= set(checkpoints) and checkpoints
    else:
        assert set(checkpoints) <= {STEPS}


def test_a_stop_alarm_saves_a_checkpoint_and_ends_the_process_with_its_own_exit_code(runaway):
    out, result = runaway["stop"]
    assert result.exit_code == EXIT_KL_ALARM == 4, result.output
    first = events(out, "kl_alarm")
    assert len(first) == 1 and first[0]["action"] == "stop"
    step = first[0]["step"]
    assert f"KL alarm at step {step}" in result.output and ("5e-4" in result.output or "0.0005" in result.output)
    assert f"--resume-from-checkpoint {out / f'checkpoint-{step}'}" in result.output
    assert (out / f"checkpoint-{step}" / "trainer_state.json").is_file()
    assert max(losses(out)) == step  # no step after the alarm's
