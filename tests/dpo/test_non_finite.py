"""The guard in training (dpo/trainer.py, issue 34 family 3): a non-finite loss, gradient norm or weights to be saved
stops train-dpo with its own exit code (3), a message naming the step and the last checkpoint written (or none), no
final model, and no metric that records the NaN as 0.0. End to end through the real Trainer loop: a loss that turns
NaN at step 2, a gradient that does while the loss stays finite, and a learning rate so large that the first update
makes the weights infinite."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

import dpo.trainer
from dpo.cli import main
from dpo.trainer import MetricsFile, finite_or_null
from runtime.cli import EXIT_FAILED, EXIT_NON_FINITE, EXIT_OK, EXIT_REFUSED
from runtime.errors import NonFiniteError

TRAIN = ["--use-cpu", "--per-device-train-batch-size", "4", "--logging-steps", "1", "--no-plot", "--seed", "3"]


def train(llama_dir, dpo_data, dpo_cache, out, *args):
    return CliRunner().invoke(main, [str(a) for a in ["--model", llama_dir, "--data", dpo_data, "--ref-cache",
                                                      dpo_cache, "--output-dir", out, *TRAIN, *args]])


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def going_bad_at(monkeypatch, step: int, how: str):
    """Patch the loss the Trainer calls so that training step `step` (1-based, counted over the loss calls that
    build a graph) gives a NaN loss ("loss") or a finite loss whose gradient is NaN ("gradient")."""
    real = dpo.trainer.dpo_loss
    calls = []

    def dpo_loss(policy_logps, *args, **kwargs):
        loss, metrics = real(policy_logps, *args, **kwargs)
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) == step:
                if how == "loss":
                    loss = loss * float("nan")
                else:  # sqrt at 0: value 0, gradient inf; times 0: a NaN gradient on every weight it reaches
                    zero = (policy_logps - policy_logps.detach()).sum()
                    loss = loss + 0.0 * torch.sqrt(zero)
        return loss, metrics

    monkeypatch.setattr(dpo.trainer, "dpo_loss", dpo_loss)


def test_the_exit_code_is_its_own():
    assert NonFiniteError.exit_code == EXIT_NON_FINITE == 3
    assert EXIT_NON_FINITE not in (EXIT_OK, EXIT_FAILED, EXIT_REFUSED, 130)


@pytest.mark.parametrize("how, what", [("loss", "the loss is nan"), ("gradient", "the gradient norm is nan")])
def test_a_non_finite_loss_or_gradient_stops_the_run_at_its_step(llama_dir, dpo_data, dpo_cache, tmp_path,
                                                                 monkeypatch, how, what):
    out = tmp_path / "run"
    going_bad_at(monkeypatch, 2, how)
    result = train(llama_dir, dpo_data, dpo_cache, out, "--max-steps", 3, "--save-steps", 1)
    monkeypatch.undo()
    assert result.exit_code == EXIT_NON_FINITE, result.output
    assert f"error: training stopped at step 2: {what} (not finite)" in result.output
    assert f"Last checkpoint written: {out / 'checkpoint-1'}." in result.output and "no final model" in result.output
    assert not (out / "model.safetensors").exists() and not (out / "run-manifest.json").exists()
    assert not (out / "checkpoint-2").exists()  # nothing from the bad step on
    assert json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())["global_step"] == 1
    logged = records(out)
    assert [r["step"] for r in logged] == [1]  # the bad step is never logged, so never averaged into a 0.0
    assert all(v != 0.0 for r in logged for k, v in r.items() if k in ("loss", "grad_norm"))
    assert math.isfinite(logged[0]["loss"]) and math.isfinite(logged[0]["grad_norm"])


@pytest.mark.parametrize("save", ["checkpoint", "final"])
def test_weights_made_infinite_by_a_huge_learning_rate_are_never_saved(llama_dir, dpo_data, dpo_cache, tmp_path,
                                                                       save):
    """Step 1's loss and gradient are finite; its update (learning rate 1e39) is not. The checkpoint of step 1, or
    with no checkpoints the final model, is refused before its folder or file is made."""
    out = tmp_path / "run"
    extra = ["--save-steps", 1, "--max-steps", 2] if save == "checkpoint" else ["--save-strategy", "no",
                                                                                "--max-steps", 1]
    result = train(llama_dir, dpo_data, dpo_cache, out, "--learning-rate", "1e39", *extra)
    assert result.exit_code == EXIT_NON_FINITE, result.output
    where = out / "checkpoint-1" if save == "checkpoint" else out
    assert (f"training stopped at step 1: the weights to be saved to {where} are NaN or infinite in places"
            in result.output), result.output
    assert "Last checkpoint written: none." in result.output
    assert not (out / "model.safetensors").exists() and not (out / "checkpoint-1").exists()
    assert [r["step"] for r in records(out)] == [1] and math.isfinite(records(out)[0]["loss"])


def test_a_non_finite_metric_is_written_as_null_never_as_a_number(tmp_path):
    """metrics.jsonl holds strict JSON: NaN and the infinities are null (an eval loss over NaN values, say)."""
    assert finite_or_null({"loss": math.nan, "a": math.inf, "b": -math.inf, "c": 0.5, "d": 3}) == {
        "loss": None, "a": None, "b": None, "c": 0.5, "d": 3}

    class State:
        global_step, epoch, is_world_process_zero = 4, 1.0, True

    path = tmp_path / "metrics.jsonl"
    MetricsFile(path).on_log(None, State(), None, logs={"eval_loss": math.nan, "eval_rewards/margins": 0.25})
    text = path.read_text()
    assert "NaN" not in text and json.loads(text) == {"step": 4, "epoch": 1.0, "eval_loss": None,
                                                      "eval_rewards/margins": 0.25}
