"""The registry of batching modes: one line per mode, read by --batching (its choices and help), auto (choose.py),
the manifest's `computation.batching` and the README's table of modes (`readme_table`)."""

from __future__ import annotations

from .base import BatchingMode
from .full_forward import FullForward
from .kv_cache import KvCache
from .packed import Packed
from .shared_prompt import SharedPrompt
from .single import Single
from .varlen import Varlen

# The order is --batching's and the README's; on equal estimates auto takes full_forward, then the later-registered.
REGISTRY: dict[str, BatchingMode] = {mode.name: mode for mode in (
    FullForward(),
    Varlen(),
    KvCache(),
    SharedPrompt(),
    Packed(),
    Single(),
)}
MODES = tuple(REGISTRY)  # the modes registered at import


def lookup(name: str) -> BatchingMode:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown batching mode {name!r}; one of {', '.join(REGISTRY)}") from None


def batching_help() -> str:
    """--batching's help text: every registered mode with its description, then what auto does."""
    modes = " ".join(f"{name}: {mode.description}." for name, mode in REGISTRY.items())
    return ("How pairs go through the model (same numbers either way). " + modes + " auto estimates the work of "
            "each mode the attention supports on the first shard and takes the cheapest. Every mode is first "
            "checked against the model's plain forward of single sequences on real pairs (the longest included) and "
            "falls back if it differs; models whose numbers depend on batch shape (ALiBi, dynamic/longrope RoPE) "
            "run single.")


def readme_table(indent: str = "  ") -> str:
    """The README's table of modes (tests/precompute/test_mode_registry.py checks the README holds exactly this)."""
    rows = ["| mode | what it does (`computation.batching` in the manifest) | runs with |", "|---|---|---|"]
    rows += [f"| `{name}` | {_cell(mode.description)} | {_cell(mode.runs_with)} |" for name, mode in REGISTRY.items()]
    return "\n".join(indent + row for row in rows)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bar inside a table cell
