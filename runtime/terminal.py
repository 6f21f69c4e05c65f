"""What reaches a terminal: text from data (ids, row text, tokens, paths, store keys) can hold control and escape
characters (ESC sequences that set the window title, move the cursor, clear the screen, recolour; C1 controls such
as CSI 0x9b; a bare carriage return; bidi overrides that reorder what is shown). None of them may reach the terminal
raw, so every line a command prints goes through `echo` here, and data values are shown by `escaped`.

Two layers, one rule (`escaped`):
- a message builder shows a data value as `escaped(value)`: every character that is not printable, a newline
  included, becomes a Python-style escape (`\\x1b`, `\\n`, `\\u202e`), so a value stays on one line and shows what
  it holds;
- `echo` (used by run_cli's error paragraph and by every progress, summary, report and view line) applies the same
  rule to the whole message, line by line: only the newlines the message itself lays out are kept. So a message
  built anywhere, from values nobody wrapped, still prints no control character.

`escaped` leaves backslashes alone, so applying it twice changes nothing: the two layers never double-escape.
Colour (audit-ref --show) is only used where `colour_wanted` says so: the stream is a terminal, NO_COLOR is unset or
empty (no-color.org) and TERM is not `dumb`; `style` escapes its text before adding the colour codes, and `echo`
keeps only the colour (SGR) sequences `style` makes, escaping everything else."""

from __future__ import annotations

import os
import re
import sys
import unicodedata

import click

NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# the select-graphic-rendition sequences click.style writes (colour, bold, dim, reset): the only escapes echo keeps,
# and only in text that `style` made
SGR = re.compile(r"(\x1b\[[0-9;]*m)")


def _escape_char(ch: str) -> str:
    if ch in NAMED:
        return NAMED[ch]
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escaped(text) -> str:
    """`text` (any value: str() of it) with every character that is not printable (str.isprintable: C0 and C1
    controls, DEL, newline, tab, format characters such as bidi overrides and zero-width marks, line and paragraph
    separators, unassigned code points, lone surrogates) written as a Python-style escape; printable text as it is.
    Idempotent: backslashes are not escaped."""
    text = text if isinstance(text, str) else str(text)
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape_char(ch) for ch in text)


def holds_control(text: str) -> bool:
    """Whether `text` holds a control character (Unicode Cc: a newline, a carriage return, ESC, a C1 control): data
    text that would print as a forged line of a message, which options and paths refuse outright."""
    return any(unicodedata.category(ch) == "Cc" for ch in text)


def printable(message) -> str:
    """A whole message for the terminal: `escaped` line by line, keeping the newlines that lay the message out."""
    message = message if isinstance(message, str) else str(message)
    return "\n".join(escaped(line) for line in message.split("\n"))


# An error line longer than this is cut in its middle: a value echoed in a refusal can be as long as what a user
# (or a file) gave, a 20 MB path, a config value whose aliases expand to gigabytes.
LONGEST_ERROR_LINE = 2000


def clipped(message) -> str:
    """An error paragraph with each line of over LONGEST_ERROR_LINE characters cut in its middle, saying how much."""
    message = message if isinstance(message, str) else str(message)
    def clip(line: str) -> str:
        if len(line) <= LONGEST_ERROR_LINE:
            return line
        keep = LONGEST_ERROR_LINE // 2
        return f"{line[:keep]} … ({len(line) - keep - keep // 2:,} characters left out) … {line[-(keep // 2):]}"
    return "\n".join(clip(line) for line in message.split("\n"))


def colour_wanted(stream=None) -> bool:
    """Colour only on a terminal, and not where the user turned it off (NO_COLOR set and not empty; TERM=dumb); a
    click context's explicit `color` decides instead."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.color is not None:
        return bool(ctx.color)
    stream = sys.stdout if stream is None else stream
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:  # click's own test of a terminal (which its test runner answers as asked)
        return not click.utils.should_strip_ansi(stream)
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def style(text, colour: bool, **kwargs) -> str:
    """`text` escaped, then coloured with click.style(**kwargs) when `colour`."""
    text = escaped(text)
    return click.style(text, **kwargs) if colour else text


def echo(message="", err: bool = False, colour: bool = False) -> None:
    """Print one message (a line or a paragraph) through `printable`. `colour`: the message was built with `style`
    for a stream where `colour_wanted`; its colour sequences are kept, everything else is still escaped (without it
    no escape sequence at all is printed)."""
    message = message if isinstance(message, str) else str(message)
    if colour:
        text = "".join(part if SGR.fullmatch(part) else printable(part) for part in SGR.split(message))
    else:
        text = printable(message)
    click.echo(text, err=err, color=True if colour else None)


def counted(n: int, unit: str, plural: str | None = None) -> str:
    """'1 row', '3 rows', '1,024 shards': a count and its unit, in the number it takes."""
    return f"{n:,} {unit if n == 1 else plural or unit + 's'}"
