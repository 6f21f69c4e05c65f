"""Issue 34 family 5: every public reader of a cache returns the current version's rows in their logical types, the
values and types of the verified reader (`open_cache(...).scan()`): log-probs as float32 log-probs (a top-k cache's
16-bit codes decoded by the one codec), top-k ids and log-probs as one list of K per token. Run over a top-k cache
and over the same cache after `precompute-ref --update` (whose folder also holds the superseded shards)."""

from __future__ import annotations

import re

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from conftest import REPO, pref_rows, write_jsonl
from conftest import precompute_ok as ok
from schemas import format as fmt
from schemas import read_cache, to_dataset
from schemas.cache import open_cache
from schemas.card import dataset_card

K, PER_SHARD = 4, 6


@pytest.fixture(scope="module")
def caches(tmp_path_factory, llama_dir):
    """{"top_k": a --top-k 4 cache of 20 rows, "updated": a copy brought by --update to data with 2 rows removed and
    3 added (its folder holds the shards of both versions)}."""
    import shutil

    base = tmp_path_factory.mktemp("readers")
    rows = pref_rows(23, seed=5)
    first = write_jsonl(base / "v1.jsonl", rows[:20])
    top = ["--rows-per-shard", PER_SHARD, "--top-k", K]
    ok("--model", llama_dir, "--data", first, "--out", base / "top_k", *top)
    shutil.copytree(base / "top_k", base / "updated")
    ok("--model", llama_dir, "--data", write_jsonl(base / "v2.jsonl", rows[2:]), "--out", base / "updated",
       "--update", *top)
    return {"top_k": base / "top_k", "updated": base / "updated"}


def verified(cache) -> pa.Table:
    """The verified reader's rows: every shard column, in the shard's order (scan appends the index columns)."""
    opened = open_cache(cache)
    return opened.scan().select([c.name for c in opened.columns])


def plain(t: pa.DataType) -> pa.DataType:
    """A type as a value's type: large and small strings and lists alike (polars hands out the large ones), list
    fields unnamed."""
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(plain(t.value_type))
    return t


def assert_same_columns(got: pa.Table, want: pa.Table, columns=None):
    for name in columns or want.column_names:
        g, w = got.schema.field(name).type, want.schema.field(name).type
        assert plain(g) == plain(w), (name, g, w)
        assert got.column(name).to_pylist() == want.column(name).to_pylist(), name


@pytest.mark.parametrize("which", ["top_k", "updated"])
def test_every_public_reader_gives_the_verified_readers_values_and_types(caches, which, tmp_path, monkeypatch):
    cache = caches[which]
    want = verified(cache)
    manifest = fmt.read_manifest(cache)
    assert want.num_rows == manifest["rows"] == (20 if which == "top_k" else 21)
    assert want.schema.field("chosen_top_logps").type == pa.list_(pa.list_(pa.float32()))
    assert want.schema.field("rejected_top_ids").type == pa.list_(pa.list_(pa.int32()))
    # the verified values are log-probs: each token's K values descending, <= 0, and a distribution's mass
    for row in want.column("chosen_top_logps").to_pylist()[:3]:
        values = np.array(row)
        assert values.shape[1] == K and (values <= 0).all() and (np.diff(values, axis=1) <= 0).all()
        assert (np.exp(values).sum(1) <= 1 + 1e-3).all()
    # read_cache: a polars LazyFrame over the manifest's shards, decoded
    frame = read_cache(cache).collect()
    assert frame.columns == want.column_names
    assert_same_columns(frame.to_arrow(), want)
    # ... queried lazily: projection, a predicate and a limit give the same values
    some = want.column("id").to_pylist()[-3:]
    picked = read_cache(cache).select("id", "chosen_top_logps", "rejected_top_ids").filter(pl.col("id").is_in(some))
    assert_same_columns(picked.collect().to_arrow(), want.filter(pa.compute.is_in(want.column("id"),
                                                                                  pa.array(some))),
                        ["id", "chosen_top_logps", "rejected_top_ids"])
    assert read_cache(cache).head(2).collect()["id"].to_list() == want.column("id").to_pylist()[:2]
    assert read_cache(cache).select(pl.len()).collect().item() == want.num_rows
    # to_dataset: a datasets.Dataset of the same values and types
    dataset = to_dataset(cache)
    assert dataset.column_names == want.column_names and len(dataset) == want.num_rows
    assert_same_columns(dataset.data.table, want)
    # datasets.load_dataset(CACHE_DIR), through the card: the current shards only, and only the columns whose stored
    # form is their value (the top-k ids and log-probs are left out, never handed out as codes)
    import datasets

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    loaded = datasets.load_dataset(str(cache), split="train", cache_dir=str(tmp_path / "hf" / "datasets"))
    stored_form = {c.name for c in open_cache(cache).columns if c.physical is not None}
    assert stored_form == {f"{side}_top_{what}" for side in fmt.SIDES for what in ("ids", "logps")}
    normalised = {f"{side}_tail" for side in fmt.SIDES}  # read normalised with the top-k log-probs: not as stored
    assert set(loaded.column_names) == set(want.column_names) - stored_form - normalised
    assert len(loaded) == want.num_rows
    assert_same_columns(loaded.data.table, want, loaded.column_names)
    # the pyarrow way: the verified reader's rows shard by shard (Cache.rows), what the readers above are made of
    assert_same_columns(pa.concat_tables(open_cache(cache).rows()), want)


def test_the_raw_files_hold_codes_and_an_updated_folder_more_rows_than_its_version(caches):
    """Why no reader globs the folder or reads the files as stored: what the issue's hostile user saw."""
    cache = caches["updated"]
    manifest = fmt.read_manifest(cache)
    everything = pl.read_parquet(f"{cache}/*.parquet")
    assert everything.height > manifest["rows"] and everything["id"].n_unique() > manifest["rows"]
    raw = pl.read_parquet([str(cache / s["file"]) for s in manifest["shards"]])
    assert raw.schema["chosen_top_logps"] == pl.List(pl.UInt16)  # the storage, not the contract
    assert read_cache(cache).collect().schema["chosen_top_logps"] == pl.List(pl.List(pl.Float32))


GLOB = re.compile(r"\*\.parquet")


def test_nothing_recommends_reading_a_cache_with_a_glob(caches):
    """Every mention of a `*.parquet` glob in the README, FORMAT.md, the readers' docstrings and the dataset card
    says not to use one."""
    import schemas.cache

    texts = {"README.md": (REPO / "README.md").read_text(), "FORMAT.md": (REPO / "schemas" / "FORMAT.md").read_text(),
             "read_cache": schemas.cache.read_cache.__doc__, "to_dataset": schemas.cache.to_dataset.__doc__,
             "card": str(dataset_card(fmt.read_manifest(caches["updated"])))}
    for name, text in texts.items():
        for sentence in re.split(r"(?<=[.!?])\s+", text):
            if GLOB.search(sentence) and re.search(r"read|scan|load|glob", sentence):
                assert re.search(r"\b(not|never|no)\b", sentence, re.I), (name, sentence)
