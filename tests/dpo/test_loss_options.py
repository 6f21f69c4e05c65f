"""The loss registry (dpo/loss_config.py: each loss declares the options it reads) is what the formulas read, and an
option the chosen loss does not read is refused, on the command line and in a config file, naming the option and the
losses that read it (issue 34 family 3). Enumerated over the registry x the loss options."""

from __future__ import annotations

import dataclasses

import click
import pytest
import torch
from click.testing import CliRunner

from dpo.cli import main, resolve_config
from dpo.loss_config import LOSSES, LOSS_TYPES, LossConfig, readers
from dpo.losses import BetaDPO, TopK, dpo_loss

OPTIONS = [f.name for f in dataclasses.fields(LossConfig) if f.name != "loss_type"]
# a value of each option other than its default, inside its domain, that the formulas would feel
OTHER = {"beta": 0.3, "label_smoothing": 0.2, "rpo_alpha": 0.5, "ld_alpha": 0.5, "tdpo_alpha": 0.9, "kl_coef": 0.5,
         "beta_dpo_alpha": 1.5, "beta_dpo_rho": 0.5, "beta_dpo_momentum": 0.5}
REQUIRED = {"model": "m", "data": "d", "output_dir": "o"}


def test_the_registry_names_every_loss_and_every_option_has_a_reader():
    assert tuple(LOSSES) == LOSS_TYPES
    assert set(OTHER) == set(OPTIONS)
    for name in OPTIONS:
        assert readers(name), f"{name}: no loss reads it; declare it in dpo/loss_config.LOSSES"
    for loss, options in LOSSES.items():
        assert set(options) <= set(OPTIONS), loss


def batch(seed=0):
    """Three pairs of unequal lengths with per-token log-probs and a top-k distribution (K = 3) for every token, the
    policy away from the reference."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 1, 4, 2, 5, 1])
    n = int(lengths.sum())
    policy = torch.log_softmax(torch.randn(n, 4, generator=g, dtype=torch.float64), -1)
    ref = torch.log_softmax(torch.randn(n, 4, generator=g, dtype=torch.float64), -1)
    top_k = TopK(policy[:, :3], policy[:, 3], ref[:, :3], ref[:, 3])
    return policy[:, 0] * 0.3, ref[:, 0] * 0.3, lengths, top_k


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("option", OPTIONS)
def test_a_loss_reads_exactly_the_options_it_declares(loss_type, option):
    """Changing an option away from its default moves the loss if and only if the registry says the loss reads it."""
    policy, ref, lengths, top_k = batch()

    def loss(cfg):  # a training batch of beta_dpo carries its state (BetaDPO: the batch's beta and kept pairs)
        state = {"beta_dpo": BetaDPO(cfg)} if loss_type == "beta_dpo" else {}
        return dpo_loss(policy, ref, lengths, cfg, top_k, **state)[0]

    base = loss(LossConfig(loss_type=loss_type))
    moved = loss(LossConfig(loss_type=loss_type, **{option: OTHER[option]}))
    reads = option in LOSSES[loss_type]
    assert (abs(moved.item() - base.item()) > 1e-9) == reads, (loss_type, option, base.item(), moved.item())


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("option", OPTIONS)
def test_an_option_the_loss_does_not_read_is_refused_on_the_command_line(loss_type, option):
    given = {**REQUIRED, "loss_type": loss_type, option: OTHER[option]}
    if option in LOSSES[loss_type]:
        cfg = resolve_config(None, given)
        assert getattr(cfg, option) == OTHER[option] and cfg.loss_type == loss_type
        return
    flag = f"--{option.replace('_', '-')}"
    with pytest.raises(click.UsageError) as raised:
        resolve_config(None, given)
    message = raised.value.message
    assert message.startswith(f"{flag} {OTHER[option]}: the {loss_type} loss does not read it"), message
    assert f"an option of {', '.join(readers(option))}" in message


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("option", OPTIONS)
def test_the_same_in_a_config_file_unless_it_holds_the_default(loss_type, option, tmp_path):
    """A TRL DPOConfig dump carries every key at its default: an unread option at its default is let through (it
    changes nothing); away from it, refused naming the file and the key. The loss may come from either place."""
    path = tmp_path / "run.yaml"
    path.write_text(f"loss_type: {loss_type}\n{option}: {OTHER[option]}\n")
    if option in LOSSES[loss_type]:
        assert getattr(resolve_config(str(path), dict(REQUIRED)), option) == OTHER[option]
    else:
        with pytest.raises(click.UsageError, match=rf"^{path}: {option} {OTHER[option]}: the {loss_type} loss"):
            resolve_config(str(path), dict(REQUIRED))
        with pytest.raises(click.UsageError, match=rf"^--{option.replace('_', '-')} {OTHER[option]}"):
            path.write_text(f"{option}: {OTHER[option]}\n")
            resolve_config(str(path), {**REQUIRED, "loss_type": loss_type, option: OTHER[option]})
    default = next(f.default for f in dataclasses.fields(LossConfig) if f.name == option)
    path.write_text(f"loss_type: {loss_type}\n{option}: {default}\n")
    assert resolve_config(str(path), dict(REQUIRED)).loss_type == loss_type


def test_the_issues_example_end_to_end(tmp_path):
    """--tdpo-alpha 0.9 with the (default) sigmoid loss: exit 2 before anything is read or written."""
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["--model", str(tmp_path / "m"), "--data", str(tmp_path / "d"), "--output-dir",
                                       str(out), "--tdpo-alpha", "0.9"])
    assert result.exit_code == 2, result.output
    assert "--tdpo-alpha 0.9: the sigmoid loss does not read it (it is an option of tdpo2)" in result.output
    assert "--loss-type tdpo2" in result.output and not out.exists()


def test_the_losss_own_rule_beyond_the_domain_is_a_usage_error():
    with pytest.raises(click.UsageError, match="label_smoothing must be below 0.5"):
        resolve_config(None, {**REQUIRED, "label_smoothing": 0.5})


def test_the_card_shows_only_the_options_the_loss_reads():
    from dpo.card import OPTIONS as CARD_OPTIONS
    from dpo.card import _applies

    for loss_type, options in LOSSES.items():
        config = {"loss_type": loss_type, **OTHER}
        shown = {o for o in OPTIONS if o in CARD_OPTIONS and _applies(o, config)}
        assert shown == {o for o in options if o in CARD_OPTIONS}, loss_type


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_run_manifest_records_an_unread_option_as_null(loss_type):
    """run-manifest.json's config: the options the loss reads with their values, the others null (a sigmoid run's
    tdpo_alpha is not a value that looks used)."""
    from dpo.provenance import recorded_config
    from dpo.config import TrainConfig

    config = recorded_config(TrainConfig(model="m", data="d", output_dir="o", loss_type=loss_type))
    for name in OPTIONS:
        default = next(f.default for f in dataclasses.fields(LossConfig) if f.name == name)
        assert config[name] == (default if name in LOSSES[loss_type] else None), (loss_type, name)
    assert config["loss_type"] == loss_type and config["learning_rate"] == TrainConfig.learning_rate
