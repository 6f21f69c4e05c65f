"""The one config-file reader (runtime/config_file.py) against a hostile file (found by the hostile pass): an alias
bomb, a device / FIFO / huge file, and an option given twice are refused with exit 2 naming the file, for both
commands; each TRL alias is read by each command as its command line reads it. From the user's side: the command as
typed, the message and the exit status asserted."""

from __future__ import annotations

import os
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from dpo.cli import main as train_dpo
from precompute.cli import main as precompute_ref
from runtime.config_file import MAX_BYTES
from runtime.options import TRL_ALIASES

ROOT = Path(__file__).resolve().parents[2]
MODEL, DATA = ROOT / "data" / "sft-model", ROOT / "data" / "prefs" / "train.jsonl"
COMMANDS = {"precompute-ref": precompute_ref, "train-dpo": train_dpo}


def _run(command: str, config, *more):
    result = CliRunner().invoke(COMMANDS[command], ["--config", str(config), *map(str, more)])
    return result.exit_code, " ".join(result.output.split())


def _file(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _bomb(levels: int) -> str:
    nested = ["&l0 [a,a,a,a,a,a,a,a,a]"] + [f"&l{i} [{','.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return f"top_k: [{', '.join(nested)}]\n"


@pytest.mark.parametrize("command", COMMANDS)
def test_anchors_and_aliases_are_refused_before_anything_is_expanded(command, tmp_path):
    refused = "YAML anchors and aliases are not taken in a config file; write the value out"
    cases = {"bomb.yaml": (_bomb(8), 1),  # 334 bytes expanding to 9**8 items: 600 MB and 9 s before
             "anchor.yaml": ("beta: &b 0.1\nrpo_alpha: 0.5\n", 1),
             "merge.yaml": ("base: &base {top_k: 4}\nrun:\n  <<: *base\n", 1)}  # YAML 1.1 merge keys go with them
    for name, (text, line) in cases.items():
        code, output = _run(command, _file(tmp_path / name, text))
        assert code == 2 and f"{tmp_path / name}: line {line}: {refused}" in output, (name, output)
        assert len(output) < 400, (name, len(output))
    code, output = _run(command, _file(tmp_path / "inline.yaml", "<<: {top_k: 4}\n"))
    assert code == 2 and "unknown option(s) <<" in output, output  # YAML 1.2: `<<` is a key like any other


@pytest.mark.parametrize("command", COMMANDS)
def test_only_a_regular_file_within_the_size_is_read(command, tmp_path):
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.yaml")  # nobody writes it: reading would wait forever
    for path in ("/dev/zero", tmp_path / "zero.yaml", tmp_path / "fifo.yaml"):
        code, output = _run(command, path)
        assert code == 2 and f"{path}: not a regular file" in output, output
    big = _file(tmp_path / "big.yaml", "#" * MAX_BYTES + "\n")  # comments only, one byte over
    code, output = _run(command, big)
    assert code == 2 and f"{big}: {MAX_BYTES + 1} bytes; a config file is at most {MAX_BYTES} bytes" in output
    real = _file(tmp_path / "real.yaml", "beta: 0.1\n" if command == "train-dpo" else f"model: {MODEL}\n")
    (tmp_path / "link.yaml").symlink_to(real)  # a symlink to a regular file is read
    code, output = _run(command, tmp_path / "link.yaml")
    assert code == 2 and "missing --data" in output.replace("missing --model, --data", "missing --data"), output


DUPLICATES = {  # file name: (text, the keys named, in order, with their values)
    "same.yaml": ("top_k: 4\nbeta: 0.1\ntop_k: 2\n", "line 3: top_k is given twice (line 1: 4; line 3: 2)"),
    "same.json": ('{"top_k": 4, "top_k": 2}', "top_k is given twice (4; 2)"),
    "spelt.yaml": ("rows_per_shard: 4\nrows-per-shard: 6\n", "line 2: rows_per_shard and rows-per-shard both give"),
    "spelt.json": ('{"top-k": 4, "top_k": 2}', "top-k and top_k both give"),
    "alias.yaml": (f"model_name_or_path: {MODEL}\nmodel: {DATA}\n", "line 2: model_name_or_path and model both give"),
    "nan.yaml": ("beta: .nan\nbeta: 0.1\n", "line 2: beta is given twice (line 1: nan; line 2: 0.1)"),
    "type.yaml": ("top_k: 1\ntop_k: true\n", "line 2: top_k is given twice (line 1: 1; line 2: True)"),
    "nested.yaml": ("lr_scheduler_kwargs: {a: 1, a: 2}\n", "line 1: a is given twice"),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_an_option_given_twice_is_refused_whatever_the_spelling_unless_the_value_is_the_same(command, tmp_path):
    for name, (text, named) in DUPLICATES.items():
        config = _file(tmp_path / name, text)
        code, output = _run(command, config)
        assert code == 2 and f"{config}: {named}" in output, (name, output)
        assert "an option is given once in a config file; keep one" in output, (name, output)
    again = _file(tmp_path / "again.yaml", f"model: {MODEL}\nmodel_name_or_path: {MODEL}\n"
                                          "attn-implementation: auto\nattn_implementation: auto\n")
    code, output = _run(command, again)  # the same value twice says one thing: read
    assert code == 2 and "missing --data" in output.replace("missing --model, --data", "missing --data"), output


def _option_of(command, name: str):
    """The option of `command` a command-line name selects, or None."""
    flag = f"--{name}"
    return next((p.name for p in command.params if flag in p.opts), None)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_trl_alias_is_read_from_a_file_as_the_command_line_reads_it(command, tmp_path):
    """Found by the hostile pass: `precompute-ref --config` with `dtype: float32` was refused as unknown (the table
    maps dtype to train-dpo's --model-dtype) though `precompute-ref --dtype` is its own option. Each alias key of
    the table, for each command: the command's own option of that name, else the table's option, else unknown; the
    file and the command line agree."""
    from dpo.config_file import load_config_file
    from runtime.config_file import options_from_file

    values = {"model": MODEL, "data": DATA, "split": "train", "eval_split": "test", "model_dtype": "float32",
              "dtype": "float32"}
    cli = COMMANDS[command]
    for alias, target in TRL_ALIASES.items():
        expected = _option_of(cli, alias.replace("_", "-"))
        assert expected == _option_of(cli, alias)  # both spellings on the command line
        if expected is None:
            assert _option_of(cli, target.replace("_", "-")) is None, (alias, target)
        config = _file(tmp_path / f"{alias}.yaml", f"{alias}: {values.get(expected or target, 'x')}\n")
        try:
            read = set(options_from_file(config, cli, command, TRL_ALIASES) if command == "precompute-ref"
                       else load_config_file(config))
        except click.UsageError as e:
            assert expected is None and "unknown option(s)" in str(e), (command, alias, e)
            continue
        assert read == {expected}, (command, alias, read)
    code, output = _run(command, _file(tmp_path / "dtype.yaml", f"model: {MODEL}\ndtype: float32\n"))
    assert code == 2 and "missing --data" in output and "unknown" not in output, output
