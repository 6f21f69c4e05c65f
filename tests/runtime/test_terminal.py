"""runtime/terminal.py: the one rule for data text on a terminal (escaped / printable), colour only where wanted,
and the mechanism: no module of a command prints except through runtime.terminal (an AST scan of every module, so
a new printing path cannot skip it). The printing paths end to end: tests/faults/test_fault_terminal.py."""

from __future__ import annotations

import ast
import io
import unicodedata
from pathlib import Path

import click
import pytest

from runtime.terminal import SGR, colour_wanted, echo, escaped, printable, style

REPO = Path(__file__).resolve().parents[2]
ROOMS = ("runtime", "precompute", "dpo", "audit", "schemas")
HOSTILE = "\x1b]0;pwned\x07\x1b[31mred\x1b[2J\r\x9b2J\u202eevil\x7f\x00\t\n\u2028\u200b"


def raw_controls(text: str, keep=("\n",)) -> list[str]:
    """The characters of `text` a terminal would act on or hide (everything str.isprintable refuses), but `keep`."""
    return [c for c in text if not c.isprintable() and c not in keep]


def test_every_non_printing_character_is_escaped_and_printable_text_kept():
    out = escaped(HOSTILE)
    assert raw_controls(out, keep=()) == []
    assert out == ("\\x1b]0;pwned\\x07\\x1b[31mred\\x1b[2J\\r\\x9b2J\\u202eevil\\x7f\\x00\\t\\n\\u2028\\u200b")
    for text in ("plain", "ünïcødé ✓ 日本語", "▁token", "a\\x1b stays as typed", "", "emoji 🙂"):
        assert escaped(text) == text


@pytest.mark.parametrize("code", [*range(0x20), 0x7F, *range(0x80, 0xA0)])
def test_every_c0_and_c1_control_and_del(code):
    out = escaped(f"a{chr(code)}b")
    assert raw_controls(out, keep=()) == [] and out.startswith("a\\") and out.endswith("b")


def test_every_format_and_separator_character_of_unicode():
    """Bidi overrides and isolates, zero-width marks, line and paragraph separators: every code point of those
    categories (not a hand list)."""
    chars = [chr(c) for c in range(0x110000) if unicodedata.category(chr(c)) in ("Cf", "Zl", "Zp")]
    assert "\u202e" in chars and "\u2066" in chars and "\u2028" in chars
    assert raw_controls(escaped("".join(chars)), keep=()) == []


def test_escaping_twice_changes_nothing():
    once = escaped(HOSTILE)
    assert escaped(once) == once and printable(once) == once


def test_a_message_keeps_its_own_newlines_and_nothing_else():
    message = f"error: row {HOSTILE!s}\n  remedy:   do this"
    out = printable(message)
    assert out.count("\n") == message.count("\n") and out.endswith("\n  remedy:   do this")
    assert raw_controls(out) == []
    # a value shown by escaped stays on its line
    assert printable(f"id {escaped('a' + chr(10) + 'b')}") == "id a\\nb"


def test_echo_prints_no_control_character(capsys):
    echo(f"line {HOSTILE}")
    echo(f"line {HOSTILE}", err=True)
    out, err = capsys.readouterr()
    assert raw_controls(out) == [] and raw_controls(err) == []
    assert "\\x1b]0;pwned\\x07" in out and "\\x1b]0;pwned\\x07" in err


def test_colour_keeps_only_the_colours_style_makes(capsys):
    echo(style(HOSTILE, True, fg="red") + " and " + HOSTILE, colour=True)
    out = capsys.readouterr().out
    plain = SGR.sub("", out)
    assert raw_controls(plain) == []
    assert out.startswith("\x1b[31m") and "\\x1b[31m" in plain  # our red kept, the data's shown as text
    # without colour, not even a colour sequence
    echo(style(HOSTILE, False, fg="red"))
    assert "\x1b" not in capsys.readouterr().out


class Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


@pytest.mark.parametrize("env,tty,wanted", [
    ({}, True, True), ({}, False, False), ({"NO_COLOR": "1"}, True, False), ({"NO_COLOR": ""}, True, True),
    ({"TERM": "dumb"}, True, False)])
def test_colour_only_on_a_terminal_without_no_color(monkeypatch, env, tty, wanted):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert colour_wanted(Stream(tty)) is wanted


def test_an_explicit_click_colour_choice_decides():
    for choice in (True, False):
        with click.Context(click.Command("x"), color=choice):
            assert colour_wanted(Stream(not choice)) is choice


# ---------------------------------------------------------------------------------------------------------------
# the mechanism: every module of every room prints through runtime.terminal, none on its own


PRINTERS = {("click", "echo"), ("click", "secho"), ("sys.stdout", "write"), ("sys.stderr", "write"),
            ("sys.stdout", "writelines"), ("sys.stderr", "writelines")}


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return inner and f"{inner}.{node.attr}"
    return None


def printing_sites(path: Path) -> list[str]:
    """Where a module writes to the console itself: print (called, or passed as a default such as log=print),
    click.echo / click.secho, sys.stdout/sys.stderr.write, `from click import echo`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Name) and node.id == "print":
            found.append(f"{where} print")
        elif isinstance(node, ast.Attribute) and (_dotted(node.value), node.attr) in PRINTERS:
            found.append(f"{where} {_dotted(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module == "click" and any(
                a.name in ("echo", "secho") for a in node.names):
            found.append(f"{where} from click import echo")
    return found


def test_no_module_prints_except_through_runtime_terminal():
    modules = [p for room in ROOMS for p in sorted((REPO / room).rglob("*.py"))]
    assert len(modules) > 50 and REPO / "runtime" / "terminal.py" in modules
    sites = [s for p in modules if p != REPO / "runtime" / "terminal.py" for s in printing_sites(p)]
    assert sites == [], "print through runtime.terminal.echo (data text escaped):\n" + "\n".join(sites)


def test_the_scan_finds_each_way_of_printing(tmp_path):
    """The scan itself can fail: each way of printing it looks for is found in a module that uses it."""
    sample = tmp_path / "sample.py"
    sample.write_text("import sys\nimport click\nfrom click import echo\n\n\ndef f(log=print):\n    print(1)\n"
                      "    click.echo(2)\n    click.secho(3)\n    sys.stderr.write('4')\n    sys.stdout.write('5')\n")
    assert len(printing_sites(sample)) == 7
