"""One implementation of a mechanism, checked on the syntax tree (a twin spelled differently is still found): every
read of a Parquet footer is `schemas.format.read_footer`, and every comparison of stamps is
`schemas.rules.stamp_findings`, which the callers that compare a cache with themselves reach through the rule book.
Cross-cutting (reads every room), so top level."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("storage", "schemas", "runtime", "precompute", "dpo", "audit")
# pyarrow's and polars' readers of a Parquet file's footer (metadata, schema, row count) without its data
FOOTER_READERS = {"read_metadata", "read_schema", "ParquetFile", "read_parquet_schema", "read_parquet_metadata"}
# what names a stamp: the manifest's `stamps`, and the two hashes by name (as a variable, attribute, key or function)
STAMP_WORDS = {"stamps", "model_hash", "tokenizer_hash"}


def functions(room_root: Path):
    """(module, qualified function name, node) of every function in the product's rooms; module level is '<module>'."""
    for room in ROOMS:
        for path in sorted((room_root / room).rglob("*.py")):
            module = ".".join(path.relative_to(room_root).with_suffix("").parts)
            tree = ast.parse(path.read_text(encoding="utf-8"))
            yield module, "<module>", tree, tree
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield module, node.name, node, tree


def _own_nodes(fn):
    """The nodes of a function's body, not those of the functions nested in it (they are scanned on their own)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def _aliases(tree) -> dict[str, str]:
    """Local names bound to a footer reader by `from ... import reader as name`."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name in FOOTER_READERS:
                    out[a.asname or a.name] = a.name
    return out


def footer_reads(room_root: Path = ROOT) -> set[str]:
    """module.function of every function that calls a footer reader (by attribute, by name or by an alias)."""
    found = set()
    for module, name, fn, tree in functions(room_root):
        aliases = _aliases(tree)
        for node in (_own_nodes(fn) if name != "<module>" else ast.iter_child_nodes(fn)):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else aliases.get(f.id) if isinstance(f, ast.Name) else None
                if called in FOOTER_READERS:
                    found.add(f"{module}.{name}")
    return found


def _mentions(node, names: set[str]) -> bool:
    """Whether an expression reads a stamp (or a variable in `names`): a name or attribute called so, or a stamp's
    key as a subscript or `.get` argument. What a function computes from one is not read here (a call's arguments
    are not looked into), nor is the name of a kind compared with a string."""
    if isinstance(node, ast.Name):
        return node.id in STAMP_WORDS or node.id in names
    if isinstance(node, ast.Attribute):
        return node.attr in STAMP_WORDS or _mentions(node.value, names)
    if isinstance(node, ast.Subscript):
        key = node.slice
        return (isinstance(key, ast.Constant) and key.value in STAMP_WORDS) or _mentions(node.value, names) \
            or _mentions(key, names)
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "get" and node.args and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value in STAMP_WORDS:
            return True
        return isinstance(f, ast.Attribute) and _mentions(f.value, names)  # a method of a stamp: stamps.items()
    if isinstance(node, (ast.Constant, ast.Lambda)):
        return False
    return any(_mentions(child, names) for child in ast.iter_child_nodes(node))


def _targets(node) -> list[str]:
    return [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]


def stamp_comparisons(room_root: Path = ROOT) -> set[str]:
    """module.function of every function with an == or != whose side names a stamp, directly or through a local
    variable bound (=, for, with, a comprehension, :=) to something that does."""
    found = set()
    for module, name, fn, _ in functions(room_root):
        if name == "<module>":
            continue
        nodes = list(_own_nodes(fn))
        tainted: set[str] = set()
        while True:  # a variable bound from a tainted one is tainted too
            before = len(tainted)
            for node in nodes:
                if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if _mentions(node.value, tainted):
                        tainted.update(t for target in targets for t in _targets(target))
                elif isinstance(node, (ast.For, ast.comprehension)) and _mentions(node.iter, tainted):
                    tainted.update(_targets(node.target))
            if len(tainted) == before:
                break
        for node in nodes:
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                if any(_mentions(side, tainted) for side in [node.left, *node.comparators]):
                    found.add(f"{module}.{name}")
    return found


def test_one_footer_reader():
    assert footer_reads() == {"schemas.format.read_footer"}


def test_one_stamp_comparison():
    assert stamp_comparisons() == {"schemas.rule_caller.stamp_findings"}


@pytest.mark.parametrize("caller, via", [
    ("dpo/verify.py", "use_findings"),  # train-dpo's run (use_findings calls stamp_findings)
    ("precompute/resume.py", "stamp_findings"),  # precompute-ref's resume against the previous manifest
    ("audit/replay.py", "stamp_findings"),  # audit-ref --model's hashes
    ("schemas/run_manifest.py", "stamp_findings"),  # audit-ref --run: the run's cache record
    ("audit/runs.py", "stamp_findings"),  # audit-ref --run of a LoRA run: its reference is the cache's model
])
def test_each_caller_compares_stamps_through_the_rule_book(caller, via):
    tree = ast.parse((ROOT / caller).read_text(encoding="utf-8"))
    calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
             for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert via in calls


def test_use_findings_compares_stamps_with_stamp_findings():
    tree = ast.parse((ROOT / "schemas" / "rule_caller.py").read_text(encoding="utf-8"))
    use = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "use_findings")
    assert "stamp_findings" in {getattr(n.func, "id", None) for n in ast.walk(use) if isinstance(n, ast.Call)}


def test_the_scan_sees_a_twin(tmp_path):
    """Control: a footer read through an alias and a stamp comparison through renamed variables are both found, in
    whichever room they hide; code that only passes a stamp on is not."""
    for room in ROOMS:
        (tmp_path / room).mkdir()
        (tmp_path / room / "__init__.py").write_text("")
    (tmp_path / "dpo" / "twin.py").write_text(
        "from pyarrow.parquet import read_schema as peek\n"
        "def stamp_of(p):\n"
        "    return peek(p).metadata\n"
        "def same(manifest, h):\n"
        "    recorded = manifest['stamps']\n"
        "    for k, v in recorded.items():\n"
        "        mine = v\n"
        "        if h != mine:\n"
        "            return False\n"
        "    return True\n"
        "def passes_on(manifest, write):\n"
        "    write(model_hash=manifest['stamps']['model_hash'])\n"
        "    return len(manifest) == 2\n")
    (tmp_path / "audit" / "twin.py").write_text(
        "import pyarrow.parquet as pq\n"
        "def rows(p):\n"
        "    return pq.ParquetFile(p).metadata.num_rows\n"
        "def ok(checkpoint, cache):\n"
        "    return checkpoint.model_hash == cache.expected\n")
    assert footer_reads(tmp_path) == {"dpo.twin.stamp_of", "audit.twin.rows"}
    assert stamp_comparisons(tmp_path) == {"dpo.twin.same", "audit.twin.ok"}
