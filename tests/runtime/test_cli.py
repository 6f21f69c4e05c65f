"""runtime/cli.py and runtime/options.py: the command frame both jobs share. Options generated from a config dataclass
(both spellings, types, choices, repeatable lists, booleans, grouped --help with the field's words and default, only
given values collected) and run_cli's exit codes (2 with one error paragraph for what the user can fix, 1 for the unexpected)."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Literal

import click
import pytest
from click.testing import CliRunner

from runtime.cli import GroupedCommand, given_values, run_cli
from runtime.options import dataclass_options, field_help
from runtime.data import DataError
from runtime.errors import JobError


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass
class Toy:
    name: str = dataclasses.field(metadata=field_help("What to call it.", "Main", required=True))
    steps: int = dataclasses.field(default=3, metadata=field_help("How many\n   steps.", "Main",
                                                                                    domain="count"))
    rate: float | None = dataclasses.field(default=None, metadata=field_help("A rate.", "Tuning",
                                                                                              domain="positive"))
    mode: Literal["fast", "slow"] = dataclasses.field(default="fast", metadata=field_help("Speed.", "Tuning"))
    colour: Colour = dataclasses.field(default=Colour.RED, metadata=field_help("A colour.", "Tuning"))
    tags: list[str] = dataclasses.field(default_factory=list, metadata=field_help("Repeatable.", "Tuning"))
    draw_plot: bool = dataclasses.field(default=True, metadata=field_help("Draw it.", "Tuning"))
    hidden: str = dataclasses.field(default="x", metadata=field_help("Not an option.", cli=False))


def command():
    seen = {}

    @click.command(cls=GroupedCommand)
    @dataclass_options(Toy)
    def main(**values):
        seen.update(given_values(values))

    return main, seen


def test_fields_become_options_in_both_spellings_with_types():
    main, seen = command()
    result = CliRunner().invoke(main, ["--name", "a", "--steps", "5", "--rate", "0.5", "--mode", "slow", "--colour",
                                       "blue", "--tags", "x", "--tags", "y", "--no-draw-plot"])
    assert result.exit_code == 0, result.output
    assert seen == {"name": "a", "steps": 5, "rate": 0.5, "mode": "slow", "colour": "blue", "tags": ["x", "y"],
                    "draw_plot": False}
    main, seen = command()
    assert CliRunner().invoke(main, ["--name", "b", "--max_steps", "1"]).exit_code == 2  # not a field
    assert CliRunner().invoke(main, ["--name", "b", "--no_draw_plot"]).exit_code == 0
    assert seen == {"name": "b", "draw_plot": False}


@pytest.mark.parametrize("args, words", [(["--steps", "2"], "Missing option '--name'"),
                                         (["--name", "a", "--steps", "0"], "'0' is out of range; expected a whole number >= 1"),
                                         (["--name", "a", "--mode", "medium"], "'medium' is not one of 'fast', 'slow'"),
                                         (["--name", "a", "--hidden", "y"], "No such option '--hidden'")])
def test_bad_values_are_usage_errors(args, words):
    result = CliRunner().invoke(command()[0], args)
    assert result.exit_code == 2 and words in result.output, result.output


def test_help_is_grouped_and_uses_the_field_metadata():
    text = CliRunner().invoke(command()[0], ["--help"], terminal_width=200).output
    assert text.index("Main options:") < text.index("Tuning options:") < text.index("Other options:")
    assert "--steps, --steps" not in text and "How many steps. [default: 3]" in text  # whitespace folded
    assert "--name TEXT" in text and "What to call it." in text and "[default" not in text.split("What to call it.")[1].split("\n")[0]
    assert "[default: red]" in text and "--draw-plot, --draw_plot / --no-draw-plot, --no_draw_plot" in text and "--hidden" not in text


def invoke(body, debug=False):
    @click.command()
    def main():
        run_cli(body, debug)

    return CliRunner().invoke(main, [])


def fail(error):
    def body():
        raise error
    return body


@pytest.mark.parametrize("error", [JobError("--out x is inside --model x; choose another"),
                                   DataError("p.jsonl", 4, "row has no 'chosen' value")])
def test_errors_the_user_can_fix_exit_2_in_one_paragraph(error):
    result = invoke(fail(error))
    assert result.exit_code == 2
    assert result.output == f"error: {error}\n" and "Traceback" not in result.output


def test_unexpected_errors_exit_1_and_point_to_debug():
    result = invoke(fail(ZeroDivisionError("division by zero")))
    assert result.exit_code == 1
    assert result.output.strip() == "error: unexpected ZeroDivisionError: division by zero (re-run with --debug for the traceback)"
    assert invoke(fail(ZeroDivisionError("x")), debug=True).exit_code == 1


def test_a_path_no_file_system_takes_is_refused_exit_2_not_unexpected():
    import errno
    import os

    long = "x" * 300
    result = invoke(fail(OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), long)))
    assert result.exit_code == 2 and "a path is too long for the file system" in result.output
    assert "unexpected" not in result.output


@pytest.mark.parametrize("command, args", [
    ("precompute-ref", ["--model", "m" * 300, "--data", "d.jsonl", "--out", "o"]),
    ("precompute-ref", ["--model", "data/sft-model", "--data", "d" * 300 + ".jsonl", "--out", "o"]),
    ("train-dpo", ["--model", "data/sft-model", "--data", "d" * 300 + ".jsonl", "--ref-cache", "c", "--output-dir",
                   "o"]),
    ("audit-ref", ["c" * 300])])
def test_a_name_over_255_characters_as_typed_is_refused_exit_2(command, args, tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").symlink_to(Path(__file__).resolve().parents[2] / "data")
    result = CliRunner().invoke(_commands()[command], args)
    assert result.exit_code == 2, result.output
    assert "unexpected" not in result.output and "Traceback" not in result.output


def test_an_error_line_as_long_as_a_value_given_is_cut_in_its_middle():
    result = invoke(fail(JobError("--model " + "a" * 20_000 + "z: does not exist\n  remedy: give a model")))
    first, remedy = result.output.splitlines()
    assert result.exit_code == 2 and len(first) < 2100 and "characters left out" in first
    assert first.startswith("error: --model aaa") and first.endswith("z: does not exist")
    assert remedy == "  remedy: give a model"


def test_a_body_that_succeeds_exits_0():
    assert invoke(lambda: None).exit_code == 0


# ---------------------------------------------------------------------------------------------------------------
# a boolean option followed by a true/false word, as transformers' HfArgumentParser (TRL's docs and scripts) takes it


def _commands():
    from audit.cli import main as audit_ref
    from dpo.cli import main as train_dpo
    from precompute.cli import main as precompute_ref

    return {"train-dpo": train_dpo, "precompute-ref": precompute_ref, "audit-ref": audit_ref}


def _bool_options():
    """(command, its click command, the option, one of its spellings) for every boolean option of every command."""
    for name, command in _commands().items():
        for p in command.params:
            if isinstance(p, click.Option) and p.is_flag and p.is_bool_flag:
                for spelling in p.opts:
                    yield name, command, p, spelling


@pytest.mark.parametrize("word", ["True", "true", "1", "yes", "False", "false", "0", "no"])
def test_every_boolean_option_of_every_command_takes_a_true_false_word(word):
    """Each spelling of each boolean option (enumerated from the commands, so a new one cannot skip the mechanism),
    given as `--x WORD` and as `--x=WORD`, parses as the flag (or its --no- form) would."""
    truth = word.lower() in ("true", "1", "yes")
    seen = 0
    for name, command, p, spelling in _bool_options():
        for args in ([spelling, word], [f"{spelling}={word}"]):
            positional = ["cache"] if name == "audit-ref" else []
            ctx = command.make_context(name, [*positional, *args], resilient_parsing=True)
            value = ctx.params[p.name]
            if truth:
                assert value is True, (name, args, value)
            else:  # the --no- form, or for a flag without one: not given (its default)
                assert value in ((False,) if p.secondary_opts else (False, None)), (name, args, value)
            assert "cache" not in ctx.args, (name, args)  # the word was taken, not left as an extra argument
        seen += 1
    assert seen > 50  # train-dpo alone has dozens (TrainingArguments)


def test_trl_boolean_spellings_on_train_dpo_reach_training_arguments():
    """`--bf16 True --disable-tqdm true --gradient_checkpointing True --use_cpu False` as TRL's README writes them."""
    from dpo.cli import main, resolve_config

    ctx = main.make_context("train-dpo", ["--model", "m", "--data", "d", "--output-dir", "o", "--bf16", "True",
                                          "--disable-tqdm", "true", "--gradient_checkpointing", "True",
                                          "--use_cpu", "False", "--plot", "false"])
    given = {k: v for k, v in ctx.params.items() if k not in ("config_file", "debug")}
    cfg = resolve_config(None, given)
    assert cfg.bf16 is True and cfg.training_args["disable_tqdm"] is True
    assert cfg.gradient_checkpointing is True and cfg.use_cpu is False and cfg.plot is False


def test_a_boolean_option_with_a_word_that_is_not_true_or_false_is_a_usage_error():
    from dpo.cli import main

    result = CliRunner().invoke(main, ["--model", "m", "--data", "d", "--output-dir", "o", "--bf16=maybe"])
    assert result.exit_code == 2 and "--bf16=maybe: a boolean option takes true or false" in result.output
    # a word that is not true/false after a flag is left alone: here, the next option
    result = CliRunner().invoke(main, ["--bf16", "--model", "m"])
    assert "no such option" not in result.output.lower()


def test_every_boolean_option_followed_by_a_word_that_is_not_true_or_false_is_a_usage_error_naming_both():
    """Found by the UX pass: `--bf16 maybe` (a space, not `=`) got click's raw "unexpected extra argument". Where the
    command takes no positional argument, the word after a boolean option can only be meant as its value: refused
    naming the option and the word, exit 2, for every boolean option of precompute-ref and train-dpo. audit-ref's
    CACHE may follow a flag: there the word stays its argument (the enumeration above)."""
    seen = 0
    for name, command, p, spelling in _bool_options():
        if name == "audit-ref":
            continue
        result = CliRunner().invoke(command, [spelling, "maybe"])
        assert result.exit_code == 2, (name, spelling, result.output)
        assert f"{spelling} maybe: a boolean option takes true or false" in result.output, (name, result.output)
        seen += 1
    assert seen > 50



@pytest.mark.parametrize("command, args, value", [
    ("precompute-ref", ["--model", "data/sft-model", "--data", "d.jsonl", "--out", "--overwrite", "false"], "--out"),
    ("precompute-ref", ["--model", "data/sft-model", "--data", "--debug", "true", "--out", "o"], "--data"),
    ("train-dpo", ["--model", "m", "--data", "d", "--ref-cache", "c", "--output-dir", "--bf16", "false"], "--output-dir")])
def test_an_option_given_no_value_before_a_boolean_word_is_refused_not_rewritten(command, args, value, tmp_path,
                                                                                monkeypatch):
    """Found by the hostile pass: `--out --overwrite false` wrote the cache into a folder named './--no-overwrite'
    (the true/false word folded into the flag, which then became --out's value); `--data --debug true` dropped the
    word."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(_commands()[command], args)
    assert result.exit_code == 2 and f"{value} needs a value: " in result.output, result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, args, option", [
    ("precompute-ref", ["--model", "m", "--data", "d", "--out", "o", "--split", "--debug"], "--split"),
    ("train-dpo", ["--model", "m", "--data", "d", "--run-name", "--overwrite-output-dir"], "--run-name"),
    ("train-dpo", ["--model", "m", "--data", "d", "--eval-split", "--debug"], "--eval-split")])
def test_an_option_given_another_option_as_its_value_is_refused(command, args, option, tmp_path, monkeypatch):
    """Hostile pass: `--split --debug` recorded the split '--debug' and swallowed --debug (every option that takes a
    value, not only paths)."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(_commands()[command], args)
    assert result.exit_code == 2 and f"{option} needs a value: " in result.output, result.output
    assert list(tmp_path.iterdir()) == []


def test_trls_list_form_of_a_list_option_is_read_as_its_comma_list():
    """UX pass: TRL's `--lora_target_modules q_proj v_proj` (HfArgumentParser's nargs) was 'unexpected extra argument
    (v_proj)'."""
    from runtime.cli import bool_words

    params = _commands()["train-dpo"].params
    line = bool_words(params, ["--use_peft", "--lora_target_modules", "q_proj", "v_proj", "--report_to", "tensorboard",
                               "wandb", "--bf16", "true"])
    assert line == ["--use_peft", "--lora_target_modules", "q_proj,v_proj", "--report_to", "tensorboard,wandb",
                    "--bf16"]
    assert bool_words(params, ["--lora-target-modules", "all-linear", "--bf16"]) == ["--lora-target-modules",
                                                                                     "all-linear", "--bf16"]


@pytest.mark.parametrize("command", ["precompute-ref", "train-dpo"])
def test_a_second_config_file_is_refused_not_silently_taken(command, tmp_path):
    """Hostile pass: `--config p5.yaml --config p6.yaml` dropped p5.yaml whole, without a word."""
    for name in ("a.yaml", "b.yaml"):
        (tmp_path / name).write_text("{}")
    result = CliRunner().invoke(_commands()[command], ["--config", str(tmp_path / "a.yaml"),
                                                       f"--config={tmp_path / 'b.yaml'}"])
    assert result.exit_code == 2 and "--config is given twice" in result.output, result.output


def test_every_free_text_option_of_every_command_refuses_a_control_character():
    """Enumerated: an option whose value is text (not a path, a number or a choice) is read by the one text type
    (runtime.options.Text), command line and --config alike, so a new one cannot skip the control-character rule."""
    from runtime.options import Text

    texts = [(name, p) for name, command in _commands().items() for p in command.params
             if isinstance(p, click.Option) and not p.is_flag and p.type is click.STRING]
    assert texts == [], [(n, p.name) for n, p in texts]  # no free-text option falls back to click's plain STRING
    found = [(name, p) for name, command in _commands().items() for p in command.params if isinstance(p.type, Text)]
    assert {("train-dpo", "run_name"), ("precompute-ref", "split"), ("audit-ref", "show")} <= {
        (n, p.name) for n, p in found}
    for name, p in found:
        with pytest.raises(click.BadParameter, match="holds a control character"):
            p.type.convert("x\x1b[2Jy\nz", p, None)


@pytest.mark.parametrize("signals, grace", [(1, 2.0), (2, 600.0)])
def test_sigterm_ends_a_command_blocked_in_native_code(tmp_path, signals, grace):
    """Found by the hostile pass: with SIGTERM raised as Terminated in the main thread, a command blocked in native
    code that retries on EINTR (pyarrow opening a FIFO for a shard's footer) could no longer be ended by SIGTERM
    (`kill`, `timeout`). The watchdog ends it TERM_GRACE_S after one SIGTERM, or at a second, with exit 143."""
    import os
    import signal
    import subprocess
    import sys
    import time

    fifo = tmp_path / "shard-00000.parquet"
    os.mkfifo(fifo)
    code = ("import runtime.cli as c, runtime.signals as s, pyarrow.parquet as pq; s.TERM_GRACE_S = %r; "
            "c.run_cli(lambda: pq.read_metadata(%r), False)" % (grace, str(fifo)))
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # until it waits in the FIFO's open (the kernel's wait for a writer)
            wchan = Path(f"/proc/{proc.pid}/wchan").read_text() if Path(f"/proc/{proc.pid}/wchan").exists() else ""
            if "partner" in wchan or "fifo" in wchan or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read()
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert ("did not stop within 2 s" if signals == 1 else "terminated (SIGTERM, twice)") in err, err
