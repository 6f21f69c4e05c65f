"""The rooms of the project and which way their imports may point, and no circle of imports inside a room.
Cross-cutting (reads every room), so top level.

storage (places, whole-file writes, object stores, locks, disk checks) imports nothing of ours; schemas (the
contract) imports only storage; runtime (what both jobs share) imports only schemas and storage; precompute and dpo
import runtime, schemas and storage, never each other; audit imports schemas, runtime and storage only (its replay is
the plain forward of runtime.logprobs, independent of every batching mode); fsspec is imported on the storage floor
only. Imports are read from the source (ast), so a new wrong-way import anywhere in a
module, at top level or inside a function, fails here.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("storage", "schemas", "runtime", "precompute", "dpo", "audit")
ALLOWED = {
    "storage": set(),
    "schemas": {"storage"},
    "runtime": {"schemas", "storage"},
    "precompute": {"runtime", "schemas", "storage"},
    "dpo": {"runtime", "schemas", "storage"},
    "audit": {"runtime", "schemas", "storage"},  # replay runs runtime.logprobs.reference_logps, no batching mode
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
    """Control: a storage module importing schemas, a runtime module importing dpo, and a dpo module importing
    precompute, are all reported."""
    fake = tmp_path / "proj"
    for room in ROOMS:
        (fake / room).mkdir(parents=True)
        (fake / room / "__init__.py").write_text("")
    (fake / "runtime" / "bad.py").write_text("def f():\n    from dpo.trainer import x\n")
    (fake / "dpo" / "bad.py").write_text("from precompute import MODES\nimport runtime.data\n")
    (fake / "audit" / "bad.py").write_text("from precompute.modes import score_pairs\nimport schemas.rules\n")
    (fake / "storage" / "bad.py").write_text("def f():\n    from schemas.format import LOCK\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert wrong_way("storage") == ["storage/bad.py imports schemas"]
    assert wrong_way("runtime") == ["runtime/bad.py imports dpo"]
    assert wrong_way("dpo") == ["dpo/bad.py imports precompute.MODES"]
    assert wrong_way("audit") == ["audit/bad.py imports precompute.modes"]


def importers(library: str) -> list[str]:
    """The product's modules that import `library` (top level or inside a function)."""
    found = []
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
                if any(n.split(".")[0] == library for n in names):
                    found.append(path.relative_to(ROOT).as_posix())
                    break
    return found


def test_object_stores_are_reached_from_the_storage_floor_only():
    """fsspec (the object stores' filesystems) is imported by storage/ and by no other room."""
    users = importers("fsspec")
    assert users and [u for u in users if not u.startswith("storage/")] == []


def test_the_check_sees_fsspec_imported_above_the_floor(tmp_path, monkeypatch):
    fake = tmp_path / "proj"
    for room in ROOMS:
        (fake / room).mkdir(parents=True)
    (fake / "storage" / "places.py").write_text("import fsspec.core\n")
    (fake / "dpo" / "sync.py").write_text("def f():\n    from fsspec.registry import registry\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert importers("fsspec") == ["storage/places.py", "dpo/sync.py"]


# ---------------------------------------------------------------------------------------------------------------
# no circle inside a room: its modules import each other one way only (a circle means neither module can be read, or
# changed, without the other, and only a function-level import keeps it from failing at import time)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_graph(room: str) -> dict[str, set[str]]:
    """module -> the modules of the same room it imports (absolute or relative, at top level or inside a function).
    `from package import name` points at package.name where that is a module, else at the package."""
    files = {module_name(p): p for p in sorted((ROOT / room).rglob("*.py"))}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                candidates = [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]
            else:
                continue
            for target in candidates:
                while target and target not in files:  # `import schemas.format.x` names schemas.format
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Each circle once, as 'a -> b -> a', starting from its smallest module name."""
    found = set()

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == path[0]:
                found.add(" -> ".join(path + [nxt]))
            elif nxt not in path and nxt > path[0]:
                walk(path + [nxt])

    for start in sorted(graph):
        walk([start])
    return sorted(found)


@pytest.mark.parametrize("room", ROOMS)
def test_no_circle_of_imports_inside_a_room(room):
    assert circles(room_graph(room)) == []


def test_the_check_sees_a_circle(tmp_path, monkeypatch):
    """Control: a circle of two modules (one side importing inside a function), one of three through a package's
    __init__, and a one-way import that is no circle."""
    fake = tmp_path / "proj"
    (fake / "schemas" / "sub").mkdir(parents=True)
    (fake / "schemas" / "__init__.py").write_text("from .c import thing\n")
    (fake / "schemas" / "a.py").write_text("from . import b\n")
    (fake / "schemas" / "b.py").write_text("def f():\n    from schemas.a import g\n")
    (fake / "schemas" / "c.py").write_text("import schemas.sub.d\n")
    (fake / "schemas" / "sub" / "__init__.py").write_text("")
    (fake / "schemas" / "sub" / "d.py").write_text("from .. import thing\nfrom ..a import h\n")
    (fake / "schemas" / "e.py").write_text("from .a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert circles(room_graph("schemas")) == [
        "schemas -> schemas.c -> schemas.sub.d -> schemas",
        "schemas.a -> schemas.b -> schemas.a",
    ]


def bench_graph(bench: Path) -> dict[str, set[str]]:
    """bench/ runs as scripts on its own sys.path (`import common`), so a module is its file's stem and an import of
    another stem of bench/ (top level or inside a function) is an edge."""
    files = {p.stem for p in bench.glob("*.py")}
    graph = {}
    for path in sorted(bench.glob("*.py")):
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name.partition(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module.partition(".")[0]]
            else:
                continue
            targets |= {n for n in names if n in files and n != path.stem}
        graph[path.stem] = targets
    return graph


def test_no_circle_of_imports_in_bench():
    assert circles(bench_graph(ROOT / "bench")) == []


def test_the_bench_check_sees_a_circle(tmp_path):
    (tmp_path / "page.py").write_text("import common\ndef f():\n    import part\n")
    (tmp_path / "part.py").write_text("def g():\n    from page import table\n")
    (tmp_path / "common.py").write_text("import json\n")
    assert circles(bench_graph(tmp_path)) == ["page -> part -> page"]
