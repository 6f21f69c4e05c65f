"""Every option a command's messages name is an option there is (issue 36: a train-dpo refusal named precompute-ref's
`--adapter`, train-dpo's being `--init-adapter`). Enumerated: each `--name` in the text of every string of a command's
modules (refusals, notes, remedies, help) is one of that command's own options, or one of another refcache command's
where the same statement names that command (`precompute-ref --model M --adapter A`), or a flag of a tool the
messages tell the user to run; the few that name another command's option by what it made (a cache made with
--top-k) are listed with why."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"train-dpo": "dpo", "precompute-ref": "precompute", "audit-ref": "audit"}
# flags of the tools the messages tell a user to run (torchrun, hf download, pip)
FOREIGN = {"--nproc-per-node", "--repo-type"}
PLACEHOLDERS = {"--no-x"}  # runtime/cli.py's docstring: a boolean as --x / --no-x
# (module, flag): another command's option named by what it made or recorded, without that command's name near it
NAMED_BY_WHAT_IT_MADE = {
    ("dpo/recipe.py", "--top-k"): "a cache made without --top-k (precompute-ref's option, by what it made)",
    ("audit/cli.py", "--top-k"): "the module's docstring: a cache made with --top-k",
    ("audit/runs.py", "--beta-schedule"): "the run's options (train-dpo's), as its run manifest records them",
    ("audit/runs.py", "--kl-target"): "the run's options (train-dpo's)",
    ("audit/runs.py", "--kl-alarm"): "the run's options (train-dpo's)",
    ("dpo/verify.py", "--update"): "a cache updated by precompute-ref --update (docstring)",
    ("dpo/preflight.py", "--out"): "the printed precompute-ref command (its name is in another piece of the message)",
    ("dpo/recipe.py", "--out"): "the printed precompute-ref command (its name is in another piece of the message)",
}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9](?![\w*-])")  # not a pattern (--ref-*)


def _commands() -> dict:
    from audit.cli import main as audit
    from dpo.cli import main as train
    from precompute.cli import main as precompute

    return {"train-dpo": train, "precompute-ref": precompute, "audit-ref": audit}


def _options(command: click.Command) -> set[str]:
    return {o for p in command.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)} | {
        "--help"}


def _texts(path: Path):
    """(the statement's source, the text of a string in it) for every string of a module (f-strings with their
    fields left out)."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    for stmt in ast.walk(tree):
        if not isinstance(stmt, ast.stmt) or isinstance(stmt, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            continue
        segment = ast.get_source_segment(source, stmt) or ""
        for node in ast.walk(stmt):
            if isinstance(node, ast.JoinedStr):
                yield segment, "".join(v.value if isinstance(v, ast.Constant) else " " for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield segment, node.value
    docstring = ast.get_docstring(tree)
    if docstring:
        yield docstring, docstring


@pytest.mark.parametrize("command", list(PACKAGES))
def test_every_option_a_command_names_is_one(command):
    commands = _commands()
    options = {name: _options(c) for name, c in commands.items()}
    wrong = set()
    for path in sorted((ROOT / PACKAGES[command]).rglob("*.py")):
        module = str(path.relative_to(ROOT))
        for statement, text in _texts(path):
            for flag in FLAG.findall(text):
                if flag in options[command] or flag in FOREIGN or (module, flag) in NAMED_BY_WHAT_IT_MADE:
                    continue
                if any(flag in options[other] and other in statement for other in commands if other != command):
                    continue
                wrong.add((module, flag, " ".join(text.split())[:120]))
    assert not wrong, sorted(wrong)


def test_every_option_the_shared_modules_name_is_one_of_a_command():
    """runtime/ words the messages of every command: an option it names is one of some command's, or a tool's."""
    every = set().union(*(_options(c) for c in _commands().values()))
    wrong = {(str(path.relative_to(ROOT)), flag) for path in sorted((ROOT / "runtime").rglob("*.py"))
             for _, text in _texts(path) for flag in FLAG.findall(text) if flag not in every | FOREIGN | PLACEHOLDERS}
    assert not wrong, sorted(wrong)


@pytest.mark.parametrize("command", sorted(PACKAGES))
def test_an_option_another_tool_has_is_answered_with_what_to_give_here(command):
    """runtime.cli.Command's `elsewhere`: an option TRL, transformers or the other command has (train-dpo
    --warmup_ratio, precompute-ref --output_dir) is refused by click with what to give instead, in both spellings;
    no hint stands for an option the command has (it would never be shown)."""
    from click.testing import CliRunner

    main = _commands()[command]
    own = {o for p in main.params for o in p.opts + p.secondary_opts}
    for option, hint in main.elsewhere.items():
        spellings = (option, "--" + option[2:].replace("-", "_"))
        assert not own & set(spellings)
        for typed in spellings:
            result = CliRunner().invoke(main, [typed, "1"])
            assert result.exit_code == 2 and f"No such option '{typed}'; {hint}" in result.output, result.output
    assert command == "audit-ref" or main.elsewhere  # the two jobs a TRL user runs each have some
