"""The registry of cache rules (schemas/rules.py REGISTRY) and its one walk: every registered rule has its fault case
(tests/schemas/test_rules.py), the three drivers (the first finding: open_cache and --update; everything: audit-ref;
one shard: precompute-ref's resume) judge in the registry's order, a rule added to the registry alone is applied by
all three, and schemas/FORMAT.md's table is the registry's."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
from pathlib import Path

import pytest

from audit.cache import audit_cache
from audit.checks import FAIL, SECTIONS
from precompute.resume import finished_shards
from runtime.errors import JobError
from schemas import format as fmt
from schemas import rules
from schemas.cache import open_cache
from schemas.findings import CacheError, Finding

def _fault_cases():
    """tests/schemas/test_rules.py, where each rule's fault case is (test modules are not importable by name here:
    pytest's --import-mode=importlib)."""
    spec = importlib.util.spec_from_file_location("rule_fault_cases", Path(__file__).with_name("test_rules.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cases = _fault_cases()
COMP, ENC, rows_of, write_cache, write_top_k_cache = (cases.COMP, cases.ENC, cases.rows_of, cases.write_cache,
                                                      cases.write_top_k_cache)
FORMAT_MD = Path(__file__).resolve().parents[2] / "schemas" / "FORMAT.md"
S0, S1 = "shard-00000.parquet", "shard-00001.parquet"


@pytest.fixture()
def cache(tmp_path) -> Path:
    write_cache(tmp_path / "cache", rows_of())
    return tmp_path / "cache"


def recorded(monkeypatch) -> list[tuple[str, str | None]]:
    """Every registered rule's check wrapped to note (rule, shard or None) when the walk calls it."""
    calls = []

    def noting(rule):
        def check(view):
            calls.append((rule.name, view.name if isinstance(view, rules.ShardView) else None))
            return rule.check(view)
        return dataclasses.replace(rule, check=check)

    for name, rule in list(rules.REGISTRY.items()):
        monkeypatch.setitem(rules.REGISTRY, name, noting(rule))
    return calls


def first_calls(calls) -> list[str]:
    return list(dict.fromkeys(name for name, _ in calls))


def test_every_registered_rule_has_a_fault_case():
    """A rule registered without a case in tests/schemas/test_rules.py (damage that it, and no other, finds) fails
    here."""
    covered = {rule for _, expected in (*cases.CASES.values(), *cases.TOP_K_CASES.values(),
                                        *cases.TOP_K_TABLE_CASES.values()) for rule, _ in expected}
    assert set(rules.checks()) <= covered, set(rules.checks()) - covered


def test_each_entry_is_well_formed():
    assert list(rules.REGISTRY) == [r.name for r in rules.REGISTRY.values()]
    for at, (name, rule) in enumerate(rules.REGISTRY.items()):
        assert rule.unit in (rules.MANIFEST, rules.SHARD, rules.ROWS, rules.CACHE), name
        assert rule.what and callable(rule.check) and rule.per in ("", "shard", "row"), name
        assert set(rule.needs) <= set(list(rules.REGISTRY)[:at]), f"{name} needs a rule walked after it"
        assert not rule.reports or rule.reports in rules.REGISTRY, name
    assert SECTIONS["cache"] == rules.checks()  # audit-ref reports the registry's checks, in its order


def test_the_three_drivers_walk_the_registrys_order(cache, tmp_path, monkeypatch):
    calls = recorded(monkeypatch)
    open_cache(cache)
    assert calls == [("manifest", None), ("shard_files", S0), ("shard_stamps", S0), ("shard_files", S1),
                     ("shard_stamps", S1), ("shard_unlisted", None), ("shard_checksums", S0),
                     ("shard_checksums", S1), ("cache_checksum", None), ("unique_ids", None)]
    assert first_calls(calls) == [r.name for r in rules.REGISTRY.values() if r.opened]

    calls.clear()
    top_k = tmp_path / "top-k"
    write_top_k_cache(top_k, rows_of())
    audit_cache(top_k, fmt.read_manifest(top_k))
    assert first_calls(calls) == list(rules.REGISTRY)  # a top-k cache: every rule applies
    per_shard = [n for n, s in calls if s == S1]
    assert per_shard == [r.name for r in rules.REGISTRY.values() if r.unit in (rules.SHARD, rules.ROWS)]

    calls.clear()
    manifest = fmt.read_manifest(cache)
    plan = [{**e, "start": 3 * i, "stop": 3 * (i + 1)} for i, e in enumerate(manifest["shards"])]
    resumed = finished_shards(cache, plan, manifest["stamps"], ENC, COMP)
    assert resumed.done == {S0, S1} and resumed.rescore == []
    assert calls == [(n, s) for s in (S0, S1) for n in ("shard_files", "shard_stamps")]


def toy(damage: bool = False) -> rules.Rule:
    """A new shard rule, as its one registry entry would be: it finds shard 1."""
    def check(shard):
        return [Finding("toy_shards", "toy", f"shard {shard.name} is one the toy rule refuses", shard=shard.name)] \
            if shard.name == S1 else []
    return rules.Rule("toy_shards", rules.SHARD, "no shard the toy rule refuses", check, needs=("shard_files",),
                      damage=damage)


def test_a_rule_added_to_the_registry_alone_is_applied_by_every_driver(cache, tmp_path, monkeypatch):
    monkeypatch.setitem(rules.REGISTRY, "toy_shards", toy())  # the one registry entry
    with pytest.raises(CacheError) as refused:
        open_cache(cache)
    assert (refused.value.kind, refused.value.shard) == ("toy", S1)
    assert f"shard {S1} is one the toy rule refuses" in str(refused.value)

    checks = {c.name: c for c in audit_cache(cache, fmt.read_manifest(cache)).checks}
    assert [n for n, c in checks.items() if c.status == FAIL] == ["toy_shards"]
    assert checks["toy_shards"].detail == f"1 of 2 shards: shard {S1} is one the toy rule refuses"
    assert checks["toy_shards"].shard == S1

    manifest = fmt.read_manifest(cache)
    plan = [{**e, "start": 3 * i, "stop": 3 * (i + 1)} for i, e in enumerate(manifest["shards"])]
    with pytest.raises(JobError, match=f"already holds a different cache.*\n  shard {S1} is one the toy rule"):
        finished_shards(Path(shutil.copytree(cache, tmp_path / "a")), plan, manifest["stamps"], ENC, COMP)
    monkeypatch.setitem(rules.REGISTRY, "toy_shards", toy(damage=True))  # damage of the file: scored again
    resumed = finished_shards(Path(shutil.copytree(cache, tmp_path / "b")), plan, manifest["stamps"], ENC, COMP)
    assert resumed.done == {S0} and resumed.rescore == [(S1, f"shard {S1} is one the toy rule refuses")]


def test_format_md_holds_the_registrys_table():
    """schemas/FORMAT.md's table of rules is rule_table() as it stands (print it and paste it after adding a rule)."""
    lines = FORMAT_MD.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| rule (audit check) | unit |"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    assert "\n".join(lines[start:end]) == rules.rule_table(), rules.rule_table()
    named = [line.split("`")[1] for line in lines[start + 2:end]]
    assert named == list(rules.REGISTRY)
