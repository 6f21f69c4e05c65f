"""Every numeric option of every command declares its domain once and is checked by runtime/domains.py, on the command
line and in a config file alike (issue 34 family 3). The commands are the project's console scripts (pyproject.toml)
and their options are walked from click, so a new command or option is covered or fails here. Cross-cutting (all
three commands), so top level."""

from __future__ import annotations

import importlib
import json
import tomllib
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from runtime.domains import DOMAINS, DomainType, kind_of

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
# beyond NaN and the infinities, one value outside each domain (None: the domain's only limit is finiteness)
OUTSIDE = {"finite": None, "nonnegative": "-1", "positive": "0", "probability": "1.5", "open_probability": "1",
           "factor": "1", "count": "0", "natural": "-1", "integer": "1.5", "coefficient": "1e308", "weight": "2e6",
           "scale": "-1e7"}
NOT_FINITE = ("nan", "inf", "-inf")


def commands() -> dict[str, click.Command]:
    return {name: importlib.import_module(target.split(":")[0]).main for name, target in SCRIPTS.items()}


def numeric_options(cmd: click.Command) -> list[click.Option]:
    return [p for p in cmd.params if isinstance(p, click.Option)
            and isinstance(p.type, (click.types.IntParamType, click.types.FloatParamType))]


def cases() -> list[tuple[str, str]]:
    return [(name, p.name) for name, cmd in commands().items() for p in numeric_options(cmd)]


def option(command: str, name: str) -> click.Option:
    return next(p for p in commands()[command].params if p.name == name)


def bad_values(opt: click.Option) -> list[str]:
    outside = OUTSIDE[opt.type.domain]
    return [*NOT_FINITE, *([outside] if outside is not None else [])]


def test_the_walk_sees_the_options_of_the_issue():
    found = set(cases())
    assert {("train-dpo", "kl_coef"), ("train-dpo", "tdpo_alpha"), ("train-dpo", "learning_rate"),
            ("train-dpo", "adam_beta1"), ("precompute-ref", "top_k"), ("audit-ref", "tolerance")} <= found
    assert set(SCRIPTS) == {name for name, _ in found}  # every command has numeric options
    assert set(OUTSIDE) == set(DOMAINS)


@pytest.mark.parametrize("command, name", cases())
def test_every_numeric_option_declares_a_domain(command, name):
    """Our dataclasses' fields declare `metadata={"domain": ...}` (runtime.options.option_specs refuses a number without
    one); TrainingArguments' fields are in dpo/trainer_options.py's TRAINER_DOMAINS, not taken as 'any finite'."""
    opt = option(command, name)
    assert isinstance(opt.type, DomainType), f"{command} --{name}: {opt.type!r}"
    assert opt.type.domain in DOMAINS
    assert kind_of(opt.type.domain) in (int, float)
    if command == "train-dpo":
        from dpo.options import TRAINER
        from dpo.trainer_options import TRAINER_DOMAINS

        if name in TRAINER:
            assert name in TRAINER_DOMAINS, f"TrainingArguments.{name}: add its domain to TRAINER_DOMAINS"


@pytest.mark.parametrize("command, name", cases())
def test_every_numeric_option_refuses_non_finite_and_out_of_domain_values_on_the_command_line(command, name):
    opt = option(command, name)
    flag = opt.opts[0]
    for value in bad_values(opt):
        result = CliRunner().invoke(commands()[command], [f"{flag}={value}"])
        assert result.exit_code == 2, (command, flag, value, result.output)
        assert f"Invalid value for '{flag}'" in result.output and "expected" in result.output, result.output


def config_cases() -> list[tuple[str, str]]:
    """The options of the commands that take a config file (a --config option)."""
    return [(c, n) for c, n in cases() if any(p.name == "config_file" for p in commands()[c].params)]


def test_the_commands_that_take_a_config_file():
    """train-dpo and precompute-ref (its --config since issue 36): each of their numeric options is enumerated below."""
    assert {c for c, _ in config_cases()} == {"train-dpo", "precompute-ref"}


@pytest.mark.parametrize("command, name", config_cases())
@pytest.mark.parametrize("form", ["yaml", "json"])
def test_every_numeric_option_refuses_the_same_values_in_a_config_file(command, name, form, tmp_path):
    """YAML's .nan/.inf and JSON's NaN/Infinity are numbers to their parsers: refused like the command line's text,
    naming the file and the key; so is a value out of the domain (as a number and as YAML 1.1's text)."""
    opt = option(command, name)
    yaml_of = {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}
    for value in bad_values(opt):
        path = tmp_path / f"run.{form}"
        if form == "json":
            number = float(value)
            path.write_text(json.dumps({name: int(number) if number.is_integer() else number}))
        else:
            path.write_text(f"{name}: {yaml_of.get(value, value)}\n")
        result = CliRunner().invoke(commands()[command], ["--config", str(path)])
        assert result.exit_code == 2, (name, value, result.output)
        assert f"{path}: {name}: " in result.output and "expected" in result.output, result.output


def test_the_issues_examples_end_to_end(tmp_path):
    """--kl-coef nan, --tdpo-alpha inf (trained to NaN weights before), a negative --kl-coef (a crash before)."""
    from dpo.cli import main

    for args, words in ((["--kl-coef", "nan"], "'nan' is not finite"), (["--tdpo-alpha", "inf"], "'inf' is not finite"),
                        (["--kl-coef", "-0.5"], "'-0.5' is out of range; expected a finite number >= 0")):
        result = CliRunner().invoke(main, ["--model", "m", "--data", "d", "--output-dir", str(tmp_path / "o"), *args])
        assert result.exit_code == 2 and words in result.output and args[0] in result.output, result.output
        assert not (tmp_path / "o").exists()
