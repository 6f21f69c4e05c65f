"""The rooms of the project and which way their imports may point. Cross-cutting (reads every room), so top level.

schemas (the contract) imports nothing of ours; runtime (what both jobs share) imports only schemas; precompute and
dpo import runtime and schemas, never each other; audit imports schemas and runtime only (its replay is the plain
forward of runtime.logprobs, independent of every batching mode). Imports are read from the source (ast), so a new wrong-way import anywhere in a
module, at top level or inside a function, fails here.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("schemas", "runtime", "precompute", "dpo", "audit")
ALLOWED = {
    "schemas": set(),
    "runtime": {"schemas"},
    "precompute": {"runtime", "schemas"},
    "dpo": {"runtime", "schemas"},
    "audit": {"runtime", "schemas"},  # replay runs runtime.logprobs.reference_logps, no batching mode
}


def imported_rooms(path: Path, room: str) -> set[str]:
    """Our rooms (or room.module for precompute) that a file imports; relative imports stay in their own room."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from precompute import modes` names the module precompute.modes
            names = [f"{node.module}.{a.name}" for a in node.names] if "." not in node.module else [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in ROOMS and top != room:
                found.add(".".join(name.split(".")[:2]) if top == "precompute" else top)
    return found


def wrong_way(room: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / room).rglob("*.py")):
        for target in imported_rooms(path, room):
            allowed = ALLOWED[room]
            if target not in allowed and target.split(".")[0] not in allowed:
                bad.append(f"{path.relative_to(ROOT)} imports {target}")
    return bad


@pytest.mark.parametrize("room", ROOMS)
def test_imports_point_the_right_way(room):
    assert (ROOT / room / "__init__.py").is_file()
    assert wrong_way(room) == []


def test_the_check_sees_a_wrong_way_import(tmp_path, monkeypatch):
    """Control: a runtime module importing dpo, and a dpo module importing precompute, are both reported."""
    fake = tmp_path / "proj"
    for room in ROOMS:
        (fake / room).mkdir(parents=True)
        (fake / room / "__init__.py").write_text("")
    (fake / "runtime" / "bad.py").write_text("def f():\n    from dpo.trainer import x\n")
    (fake / "dpo" / "bad.py").write_text("from precompute import MODES\nimport runtime.data\n")
    (fake / "audit" / "bad.py").write_text("from precompute.modes import score_pairs\nimport schemas.rules\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert wrong_way("runtime") == ["runtime/bad.py imports dpo"]
    assert wrong_way("dpo") == ["dpo/bad.py imports precompute.MODES"]
    assert wrong_way("audit") == ["audit/bad.py imports precompute.modes"]
