"""The product's imports and pyproject's declared dependencies agree: every library a product module imports is
declared (a core dependency, or an optional extra when every import of it is guarded by `except ImportError`), and
every core dependency is imported somewhere. Read from the source (ast) and pyproject.toml, so a new import of an
undeclared library fails here, not on a user's fresh install."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("storage", "schemas", "runtime", "precompute", "dpo", "audit")


def _guarded(tree: ast.AST) -> set[int]:
    """Line numbers of the imports inside a `try` that catches ImportError (an optional library)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                h.type is not None and "ImportError" in ast.unparse(h.type) for h in node.handlers):
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def third_party_imports() -> dict[str, bool]:
    """{top-level module: whether every import of it is guarded} over the product's rooms. A module named after an
    extra (dpo/trl.py: `pip install refcache[trl]`) is the optional part itself: its imports count as guarded."""
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("optional-dependencies", {}))
    found: dict[str, bool] = {}
    for room in ROOMS:
        for path in (ROOT / room).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            guarded = _guarded(tree)
            optional = path.stem in extras
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in ROOMS or top in sys.stdlib_module_names or top == "__future__":
                        continue
                    found[top] = found.get(top, True) and (optional or node.lineno in guarded)
    return found


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    extras = {_name(r) for reqs in project.get("optional-dependencies", {}).values() for r in reqs}
    return core, extras


def distribution(module: str) -> str:
    names = importlib.metadata.packages_distributions().get(module, [module])
    return names[0].lower().replace("_", "-")


def test_every_imported_library_is_declared():
    core, extras = declared()
    missing = []
    for module, guarded in sorted(third_party_imports().items()):
        dist = distribution(module)
        if dist not in core and not (guarded and dist in extras):
            missing.append(f"{module} (distribution {dist}{', guarded: an extra would do' if guarded else ''})")
    assert missing == [], f"imported by the product but not declared in pyproject.toml: {missing}"


def test_every_core_dependency_is_imported():
    core, _ = declared()
    imported = {distribution(m) for m in third_party_imports()}
    assert sorted(core - imported) == []
