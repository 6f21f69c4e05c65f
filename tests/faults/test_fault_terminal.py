"""Data text on the terminal (issue 34, family 4): every printing path of the three commands, given ids, text, file
and folder names that hold escape sequences (a window title, colours, a screen clear, a carriage return, the C1 CSI,
a bidi override), prints no control character raw: run_cli's refusals, precompute-ref's bad-row listing, log and
summary, train-dpo's refusals for rows and its log and summary, audit-ref's report, --show (text and token views,
with and without colour), --html's line and page. Each case also checks that the hostile text reached the output
(escaped), so a path that stopped printing the data would not pass by saying nothing. The rule itself, and the scan
that every module prints through it: tests/runtime/test_terminal.py."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from click.testing import CliRunner

from conftest import pref_rows, write_jsonl
from faultkit import TRAIN, precompute, train
from runtime.terminal import SGR

EVIL = "\x1b]0;pwned\x07\x1b[31mred\x1b[2J\r\x9b2J\u202e"
SHOWN = "\\x1b]0;pwned\\x07"  # how the window-title sequence must appear, escaped
NAME = "evil\x1b]0;pwned\x07\x1b[31m\x9b\u202e"  # a file or folder name (no "/" or NUL)


def raw_controls(text: str) -> list[str]:
    return [c for c in text if not c.isprintable() and c != "\n"]


def assert_clean(output: str, *, colour: bool = False):
    text = SGR.sub("", output) if colour else output
    assert raw_controls(text) == [], f"raw control characters {raw_controls(text)!r} in\n{output!r}"
    assert SHOWN in text, f"the hostile text did not reach the output (escaped):\n{output}"


def hostile_rows() -> list[dict]:
    rows = pref_rows(8, seed=3)
    rows[1]["id"] = "row" + EVIL + "<i>&"
    rows[2]["chosen"] = "Sure" + EVIL + " yes"
    return rows


@pytest.fixture(scope="module")
def world(tmp_path_factory, llama_dir):
    base = tmp_path_factory.mktemp("terminal")
    data = write_jsonl(base / "hostile.jsonl", hostile_rows())
    cache = base / "cache"
    r = precompute("--model", llama_dir, "--data", data, "--out", cache)
    assert r.exit_code == 0, r.output
    return {"base": base, "data": data, "cache": cache, "llama": llama_dir, "precompute_output": r.output}


def audit_out(*args, color=False):
    from audit.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args], color=color)
    return result.exit_code, result.output


# ---------------------------------------------------------------------------------------------------------------
# precompute-ref


def test_precompute_log_and_summary(world):
    assert raw_controls(world["precompute_output"]) == []


@pytest.mark.parametrize("command", ["precompute-ref", "train-dpo", "audit-ref"])
def test_a_path_holding_control_characters_is_refused_and_shown_escaped(world, tmp_path, command):
    """A path is data too: one holding a control character (a newline would start a forged line of any message
    naming it) is refused by the location type, every path option of every command (tests/test_locations.py),
    and the refusal shows it escaped."""
    hostile = tmp_path / f"out-{NAME}"
    if command == "precompute-ref":
        r = precompute("--model", world["llama"], "--data", world["data"], "--out", hostile)
        code, out = r.exit_code, r.output
    elif command == "train-dpo":
        r = train("--model", world["llama"], "--data", world["data"], "--ref-cache", world["cache"], "--output-dir",
                  hostile, *TRAIN)
        code, out = r.exit_code, r.output
    else:
        code, out = audit_out(hostile)
    assert code == 2 and "a path holding a control character is not taken" in out, out
    assert_clean(out)
    assert not hostile.exists()


def test_precompute_bad_row_listing(world, tmp_path):
    rows = hostile_rows() + [{"id": "bad" + EVIL, "prompt": "p" + EVIL, "chosen": "", "rejected": "x"}]
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    r = precompute("--model", world["llama"], "--data", data, "--out", tmp_path / "out", "--on-bad-row",
                   "skip")
    assert r.exit_code == 0 and "skipped 1 bad rows" in r.output, r.output
    assert raw_controls(r.output) == []


def test_precompute_bad_row_refusal(world, tmp_path):
    rows = hostile_rows()
    rows.append(dict(rows[1]))  # the hostile id twice
    data = write_jsonl(tmp_path / "dup.jsonl", rows)
    r = precompute("--model", world["llama"], "--data", data, "--out", tmp_path / "out")
    assert r.exit_code == 2 and "already used" in r.output, r.output
    assert_clean(r.output)


# ---------------------------------------------------------------------------------------------------------------
# train-dpo


def test_train_refusal_for_rows_missing_names_the_update(world, tmp_path):
    data = write_jsonl(tmp_path / "more.jsonl", hostile_rows() + [{**pref_rows(9, seed=3)[8], "id": "new" + EVIL}])
    r = train("--model", world["llama"], "--data", data, "--ref-cache", world["cache"], "--output-dir",
              tmp_path / "out", *TRAIN)
    assert r.exit_code == 2 and "not in the cache" in r.output, r.output
    assert "precompute-ref" in r.output and "--update" in r.output
    assert_clean(r.output)


def test_train_refusal_for_a_changed_row(world, tmp_path):
    rows = hostile_rows()
    rows[1]["chosen"] += " changed"
    data = write_jsonl(tmp_path / "edited.jsonl", rows)
    r = train("--model", world["llama"], "--data", data, "--ref-cache", world["cache"], "--output-dir",
              tmp_path / "out", *TRAIN)
    assert r.exit_code == 2 and "mask checksum mismatch" in r.output, r.output
    assert_clean(r.output)


def test_train_refusal_for_a_bad_row(world, tmp_path):
    rows = hostile_rows()
    rows[3] = {"id": "bad" + EVIL, "prompt": "p", "chosen": "", "rejected": "x"}
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    r = train("--model", world["llama"], "--data", data, "--ref-cache", world["cache"], "--output-dir",
              tmp_path / "out", *TRAIN)
    assert r.exit_code == 2 and "empty" in r.output, r.output
    assert raw_controls(r.output) == []


def test_train_usage_error_from_a_config_key(world, tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"beta": 0.1, "key" + EVIL: 1}))
    r = train("--config", config, "--model", world["llama"], "--data", world["data"], "--ref-cache", world["cache"],
              "--output-dir", tmp_path / "out", *TRAIN)
    assert r.exit_code == 2 and "unknown option" in r.output, r.output
    assert_clean(r.output)


def test_train_log_and_summary(world, tmp_path):
    out = tmp_path / "run"
    # (the Trainer's progress bar redraws its line with carriage returns: its own text, off here)
    r = train("--model", world["llama"], "--data", world["data"], "--ref-cache", world["cache"], "--output-dir", out,
              *TRAIN, "--disable-tqdm")
    assert r.exit_code == 0, r.output
    assert raw_controls(r.output) == []


# ---------------------------------------------------------------------------------------------------------------
# audit-ref


def test_audit_report(world, tmp_path):
    data = write_jsonl(tmp_path / "more.jsonl", hostile_rows() + [{**pref_rows(9, seed=3)[8], "id": "new" + EVIL}])
    code, out = audit_out(world["cache"], "--model", world["llama"], "--data", data, "--sample", 2)
    assert code == 1 and "data_rows" in out, out  # the cache's name on the first line, the ids in the detail
    assert_clean(out)


@pytest.mark.parametrize("colour", [False, True])
def test_audit_show_text_and_token_views(world, colour):
    code, out = audit_out(world["cache"], "--show", "1,2", "--model", world["llama"], color=colour)
    assert code == 0, out
    assert_clean(out, colour=colour)
    assert ("\x1b[" in out) is colour  # colour only where asked for
    # the token view: the ESC token of row 2's chosen text is on its own line, escaped
    assert re.search(r"^\s+\d+\s+\d+\s+(\x1b\[[0-9;]*m)*'\\x1b'", out, re.M), out


def test_audit_show_unknown_row(world):
    code, out = audit_out(world["cache"], "--show", "nope" + EVIL, "--model", world["llama"])
    assert code == 2 and "holds a control character" in out, out  # every free-text option (runtime.options.Text)
    assert_clean(out)


def test_audit_html_line_and_page(world, tmp_path):
    page = tmp_path / "rows.html"
    code, out = audit_out(world["cache"], "--html", page, "--all", "--model", world["llama"])
    assert code == 0 and "wrote" in out, out
    assert raw_controls(out) == []
    html = page.read_text(encoding="utf-8")
    assert raw_controls(html) == [] and SHOWN in html  # shown on the page as the console shows it
    assert "&lt;i&gt;&amp;" in html and "&amp;lt;" not in html  # HTML-escaped once, not twice


def test_a_copied_cache_with_a_hostile_manifest_is_refused_cleanly(world, tmp_path):
    """run_cli's refusal of an unreadable cache shows what it read, escaped."""
    cache = shutil.copytree(world["cache"], tmp_path / "c")
    (cache / "manifest.json").write_text("{not json" + EVIL)
    code, out = audit_out(cache)
    assert code == 2 and "not valid JSON" in out, out
    assert raw_controls(out) == []


@pytest.mark.parametrize("command", ["precompute-ref", "train-dpo", "audit-ref"])
def test_command_line_errors_of_every_command(command, tmp_path):
    """click's own errors while the options are parsed (here a path holding control characters) print by the same
    rule: every command's class (runtime.cli.Command)."""
    from audit.cli import main as audit_main
    from dpo.cli import main as train_main
    from precompute.cli import main as precompute_main

    from runtime.cli import Command

    main = {"precompute-ref": precompute_main, "train-dpo": train_main, "audit-ref": audit_main}[command]
    assert isinstance(main, Command)
    missing = str(tmp_path / NAME)
    args = {"precompute-ref": ["--model", "m", "--data", "d", "--adapter", missing],
            "train-dpo": ["--config", missing], "audit-ref": [missing]}[command]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "a path holding a control character" in result.output, result.output
    assert_clean(result.output)


@pytest.mark.parametrize("command, option", [("precompute-ref", "--split"), ("train-dpo", "--run-name"),
                                             ("train-dpo", "--hub-model-id"), ("audit-ref", "--show")])
def test_a_free_text_option_holding_a_control_character_is_refused(world, command, option, tmp_path):
    """Hostile pass: `--run-name $'x\\e[31m\\nRED'` wrote a raw ESC and a newline into the model card's heading;
    `--split` with an ESC was recorded in the manifest. Every free-text option of every command refuses one."""
    from audit.cli import main as audit_main
    from dpo.cli import main as train_main
    from precompute.cli import main as precompute_main

    main = {"precompute-ref": precompute_main, "train-dpo": train_main, "audit-ref": audit_main}[command]
    args = {"precompute-ref": ["--model", str(world["llama"]), "--data", str(world["data"]), "--out",
                               str(tmp_path / "o")],
            "train-dpo": ["--model", str(world["llama"]), "--data", str(world["data"]), "--ref-cache",
                          str(world["cache"]), "--output-dir", str(tmp_path / "o")],
            "audit-ref": [str(world["cache"])]}[command]
    result = CliRunner().invoke(main, [*args, option, "x" + EVIL + "\nRED"])
    assert result.exit_code == 2 and "holds a control character" in result.output, result.output
    assert_clean(result.output)
    assert not (tmp_path / "o").exists()
