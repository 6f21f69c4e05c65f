"""A path or value as a shell takes it back, for every line that names a place a user may copy: a printed command,
a remedy, a summary, a report's header. Here, on the lowest floor, so the contract's messages quote as the jobs do."""

from __future__ import annotations

import re
import shlex


def shell_word(value) -> str:
    """`value` quoted where a shell needs it (a space, a quote, a `$`); a placeholder for the user to fill in
    (<the reference model>) as it is."""
    text = str(value)
    if re.fullmatch(r"<[^<>'\n]+>", text):
        return text
    return shlex.quote(text)
