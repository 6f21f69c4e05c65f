"""schemas/card.py: the dataset card precompute-ref writes into a cache (README.md). huggingface_hub's own parser
reads it back with the manifest's metadata; `datasets.load_dataset(CACHE_DIR)` returns exactly the rows of the shards
(the split the cache was made from, nothing else of the folder); the card is not part of the cache's identity.
Ownership and rewriting by precompute-ref: tests/faults/test_fault_edges_writes.py; audit-ref's `card` check:
tests/audit/test_cli.py; the rule: tests/schemas/test_rules.py."""

from __future__ import annotations

import json
import shutil

import polars as pl
import pytest
from huggingface_hub import DatasetCard

from conftest import pref_rows, write_jsonl
from schemas import format as fmt
from schemas import read_cache
from schemas.cache import open_cache
from schemas.card import card_metadata, dataset_card, split_of, write_card
from storage.files import UnsafeDestination
from schemas.run_manifest import cache_record
from schemas.stamps import cache_id


@pytest.fixture(scope="module")
def held_out(tmp_path_factory, llama_dir):
    """A --top-k 4 cache of a folder's `test` split with one bad row skipped: top-k columns in their stored form,
    skipped.jsonl beside manifest.json, and a split that is not `train`."""
    from precompute.job import PrecomputeConfig, run_precompute

    base = tmp_path_factory.mktemp("card")
    write_jsonl(base / "data" / "train.jsonl", pref_rows(4, seed=2))
    write_jsonl(base / "data" / "test.jsonl", [*pref_rows(12, seed=3), {"id": "bad", "prompt": "p", "chosen": 7,
                                                                       "rejected": "no"}])
    run_precompute(PrecomputeConfig(model=str(llama_dir), data=str(base / "data"), split="test", out=str(base / "cache"),
                                    rows_per_shard=5, top_k=4, on_bad_row="skip", progress=False), log=lambda m: None)
    return base / "cache"


def test_the_card_is_a_dataset_card_with_the_manifests_metadata(dpo_cache):
    manifest = fmt.read_manifest(dpo_cache)
    card = DatasetCard.load(dpo_cache / fmt.CARD)
    shards = [e["file"] for e in manifest["shards"]]
    assert len(shards) == 3
    assert card.data.configs == [{"config_name": "default", "data_files": [{"split": "train", "path": shards}]}]
    meta = card.data.refcache
    assert meta["stamps"] == manifest["stamps"] and meta["cache_id"] == cache_id(manifest)
    assert meta["encoding"] == manifest["encoding"] and meta["computation"] == manifest["computation"]
    assert (meta["rows"], meta["shards"], meta["top_k"], meta["format_version"]) == (40, 3, 0, 1)
    assert "refcache" in card.data.tags and card.data.size_categories == ["n<1K"]
    assert card.data.pretty_name == f"refcache reference log-probs of {manifest['model']['name']} (train split)"
    for value in (*manifest["stamps"].values(), meta["cache_id"], manifest["computation"]["mode"],
                  manifest["computation"]["dtype"], "--ref-cache", "audit-ref", "load_dataset"):
        assert value in card.text, value
    # a function of the manifest alone: rendered again it is the same file; no path or software version in it; the
    # version and when it was made in its text and the version in its metadata (issue 36)
    assert str(dataset_card(manifest)) == (dpo_cache / fmt.CARD).read_text()
    content = (dpo_cache / fmt.CARD).read_text()
    assert str(dpo_cache.parent) not in content
    assert f"cache version 1 (the cache as first made {manifest['created_at']}; never updated; 40 rows)" in content
    assert meta["version"] == 1
    assert manifest["software"]["refcache"] not in content.replace(meta["cache_id"], "")


def test_load_dataset_returns_the_rows_of_the_shards_and_nothing_else(dpo_cache, held_out, tmp_path, monkeypatch):
    """datasets.load_dataset(CACHE_DIR) (HF_HOME and the datasets cache in tmp_path): the split the cache was made
    from, holding exactly the rows of the shards and their values as read_cache gives them, whatever else the folder
    holds (manifest.json, skipped.jsonl, the lock); a top-k cache's top-k ids and log-probs, whose stored form is not
    their value, are left out (issue 34: never a 16-bit code under a log-prob's name); the folder is left as it
    was."""
    import datasets

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    assert (held_out / fmt.SKIPPED).is_file() and fmt.read_manifest(held_out)["source"]["skipped"] == 1
    for cache, split, columns in ((dpo_cache, "train", 9), (held_out, "test", 11)):
        before = {p.name: p.read_bytes() for p in cache.iterdir()}
        loaded = datasets.load_dataset(str(cache), cache_dir=str(tmp_path / "hf" / "datasets"))
        assert list(loaded) == [split]
        got = pl.from_arrow(loaded[split].data.table)
        want = read_cache(cache).collect()
        top_k = fmt.top_k_of(fmt.read_manifest(cache).get("computation"))
        left_out = [c.name for c in open_cache(cache).columns  # stored as codes, or (tails) read normalised
                    if c.physical is not None or (top_k and c.name.endswith("_tail"))]
        assert len(left_out) == (6 if cache == held_out else 0)
        want = want.drop(left_out)
        assert got.columns == want.columns and len(got.columns) == columns - (2 if cache == held_out else 0)
        assert got.height == want.height == fmt.read_manifest(cache)["rows"]
        assert got.schema == want.schema and got.equals(want)
        assert {p.name: p.read_bytes() for p in cache.iterdir()} == before
    assert str(tmp_path) in datasets.load_dataset(str(dpo_cache), split="train",
                                                  cache_dir=str(tmp_path / "hf" / "datasets")).cache_files[0]["filename"]


def test_a_held_out_split_is_named_and_used_as_the_eval_cache(held_out):
    card = DatasetCard.load(held_out / fmt.CARD)
    assert card.data.configs[0]["data_files"][0]["split"] == "test"
    assert card.data.refcache["top_k"] == 4 and "--eval-ref-cache" in card.text and "--eval-split test" in card.text
    assert "chosen_top_logps" in card.text and "skipped" in card.text
    manifest = fmt.read_manifest(held_out)
    for split, named in (("validation", "validation"), ("train[:10]", "train"), (None, "train")):
        assert split_of({**manifest, "source": {**manifest["source"], "split": split}}) == named


def test_the_card_is_not_part_of_the_caches_identity(dpo_cache, tmp_path):
    """The reader (train-dpo's verifier) opens a cache with its card, with an edited card and without one (a cache
    made before cards) alike, and a run names it by the same cache_id."""
    record = cache_record(dpo_cache, fmt.read_manifest(dpo_cache)["stamps"])
    cache = shutil.copytree(dpo_cache, tmp_path / "cache")
    for edit in (lambda: (cache / fmt.CARD).write_text("---\nlicense: mit\n---\nmine\n"),
                 lambda: (cache / fmt.CARD).unlink()):
        edit()
        assert open_cache(cache).stamps == record["stamps"]
        assert cache_record(cache, record["stamps"])["cache_id"] == record["cache_id"]


def test_write_card_writes_only_a_change_and_never_through_a_link(dpo_cache, tmp_path, victim):
    cache = shutil.copytree(dpo_cache, tmp_path / "cache")
    manifest = fmt.read_manifest(cache)
    assert write_card(cache, manifest) is False  # already this card: not rewritten
    rows_once = json.loads(json.dumps(manifest))
    rows_once["shards"] = rows_once["shards"][:1]
    assert write_card(cache, rows_once) is True
    assert DatasetCard.load(cache / fmt.CARD).data.to_dict()["configs"] == card_metadata(rows_once)["configs"]
    (cache / fmt.CARD).unlink()
    (cache / fmt.CARD).symlink_to(victim)
    with pytest.raises(UnsafeDestination):
        write_card(cache, manifest)
    assert victim.read_text() == "precious\n"


def test_the_cards_version_is_checked_where_the_card_has_one(dpo_cache, tmp_path):
    """audit-ref's card check (rules.card_findings): a card whose metadata names another version than the manifest is
    a finding naming the version; a card written before the version was in the metadata is as good as it was."""
    from schemas.rule_files import card_findings

    cache = shutil.copytree(dpo_cache, tmp_path / "cache")
    manifest = fmt.read_manifest(cache)
    card = DatasetCard.load(cache / fmt.CARD)
    assert card.data.refcache["version"] == 1 and card_findings(cache, manifest) == (True, [])
    for version, findings in ((7, 1), (None, 0)):
        meta = dict(card.data.refcache)
        if version is None:
            del meta["version"]  # a card of before
        else:
            meta["version"] = version
        card.data.refcache = meta
        card.save(cache / fmt.CARD)
        present, found = card_findings(cache, manifest)
        assert present and len(found) == findings
        if found:
            assert "'refcache'" in found[0].message and found[0].found == {"version": 7}
            assert found[0].expected == {"version": 1}
