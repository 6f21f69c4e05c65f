"""Cache format version 1 (schemas/format.py): shard round trip, determinism, and the verifier's refusals."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from importlib.metadata import version as version_of
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO, pref_rows
from schemas.cache import Cache, open_cache
from schemas.encoding import EncodingConfig, encode_pair, row_id, row_mask_checksum
from schemas.format import (
    FORMAT_VERSION,
    MANIFEST,
    SHARD_SCHEMA,
    CacheError,
    StampMismatch,
    read_shard_metadata,
    shard_table,
    write_manifest,
    write_shard,
)
from schemas.stamps import combined_mask_checksum, ids_checksum

ENC = EncodingConfig(max_length=96)
COMP = {"dtype": "float32", "device_type": "cpu", "mode": "full_forward", "attn_implementation": "sdpa"}
MODEL_HASH = hashlib.sha256(b"a model").hexdigest()
TOKENIZER_HASH = hashlib.sha256(b"a tokenizer").hexdigest()
SHARDS = 3
ROWS_PER_SHARD = 4


def fake_logps(n: int, rng) -> list[float]:
    return (-rng.gamma(2.0, 1.5, size=n)).astype(np.float32).tolist()


@pytest.fixture(scope="session")
def encoded(tokenizer) -> list[dict]:
    """Twelve encoded rows with made-up per-token log-probs (float32 values)."""
    rng = np.random.default_rng(0)
    out = []
    for row in pref_rows(SHARDS * ROWS_PER_SHARD, seed=7):
        e = encode_pair(row, tokenizer, ENC)
        out.append({
            "id": row_id(row), "prompt": e.prompt_ids, "chosen": e.chosen_ids, "rejected": e.rejected_ids,
            "chosen_logps": fake_logps(len(e.chosen_ids), rng), "rejected_logps": fake_logps(len(e.rejected_ids), rng),
            "checksum": e.mask_checksum,
        })
    return out


def table_of(rows) -> pa.Table:
    return shard_table(
        [r["id"] for r in rows], [r["prompt"] for r in rows], [r["chosen"] for r in rows],
        [r["rejected"] for r in rows], [r["chosen_logps"] for r in rows], [r["rejected_logps"] for r in rows],
    )


def write_cache(root: Path, rows, shards=SHARDS, model_hash=MODEL_HASH, tokenizer_hash=TOKENIZER_HASH) -> dict:
    """A complete cache, the way a writer makes one: shards first, then the manifest."""
    root.mkdir(parents=True, exist_ok=True)
    per = len(rows) // shards
    entries, checks = [], []
    for i in range(shards):
        part = rows[i * per : (i + 1) * per]
        entries.append(write_shard(root / f"shard-{i:05d}.parquet", table_of(part), model_hash=model_hash,
                                   tokenizer_hash=tokenizer_hash, encoding=ENC, computation=COMP))
        checks += [r["checksum"] for r in part]
    manifest = {
        "format_version": FORMAT_VERSION,
        "stamps": {"model_hash": model_hash, "tokenizer_hash": tokenizer_hash,
                   "mask_checksum": combined_mask_checksum(checks, ENC.to_json())},
        "encoding": ENC.to_dict(),
        "computation": COMP,
        "shards": entries,
    }
    write_manifest(root, manifest)
    return manifest


@pytest.fixture(scope="session")
def pristine(tmp_path_factory, encoded) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "cache"
    write_cache(root, encoded)
    return root


@pytest.fixture
def cache_dir(pristine, tmp_path) -> Path:
    """A fresh copy of the complete cache, for a test to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "cache"))


def manifest_of(root: Path) -> dict:
    return json.loads((root / MANIFEST).read_text())


def refresh_entry(root: Path, name: str) -> None:
    """Rewrite the manifest's bytes and sha256 for a shard, as a forger who knows the format would."""
    m = manifest_of(root)
    for entry in m["shards"]:
        if entry["file"] == name:
            entry["bytes"] = (root / name).stat().st_size
            entry["sha256"] = hashlib.sha256((root / name).read_bytes()).hexdigest()
    write_manifest(root, m)


def refused(root: Path, kind: str, cls=CacheError, **kwargs) -> CacheError:
    with pytest.raises(cls) as err:
        open_cache(root, **kwargs)
    e = err.value
    assert e.kind == kind, f"expected kind {kind!r}, got {e.kind!r}: {e}"
    assert e.remedy and f"remedy:   {e.remedy}" in str(e)
    if e.expected is not None or e.found is not None:
        assert f"expected: {e.expected}" in str(e) and f"found:    {e.found}" in str(e)
    return e


# ---------------------------------------------------------------------------------------------------------------
# one shard


def test_shard_round_trip(tmp_path, encoded):
    rows = encoded[:5]
    path = tmp_path / "shard-00000.parquet"
    entry = write_shard(path, table_of(rows), model_hash=MODEL_HASH, tokenizer_hash=TOKENIZER_HASH, encoding=ENC,
                        computation=COMP)
    back = pq.read_table(path)
    assert back.schema.remove_metadata() == SHARD_SCHEMA
    assert back.column("id").to_pylist() == [r["id"] for r in rows]
    for col, key in (("prompt_input_ids", "prompt"), ("chosen_input_ids", "chosen"), ("rejected_input_ids", "rejected"),
                     ("chosen_logps", "chosen_logps"), ("rejected_logps", "rejected_logps")):
        assert back.column(col).to_pylist() == [r[key] for r in rows], col
    for side in ("chosen", "rejected"):
        stored = back.column(f"{side}_logps").to_pylist()
        expected = [float(np.sum(np.asarray(v, np.float32).astype(np.float64))) for v in stored]
        assert back.column(f"{side}_logp").to_pylist() == expected
        assert all(abs(s - sum(v)) < 1e-9 for s, v in zip(expected, stored))
    checks = [r["checksum"] for r in rows]
    assert back.column("mask_checksum").to_pylist() == checks
    assert checks == [row_mask_checksum(r["prompt"], r["chosen"], r["rejected"]) for r in rows]

    shard_sum = combined_mask_checksum(checks, ENC.to_json())
    raw = pq.read_schema(path).metadata
    assert {k: raw[k.encode()].decode() for k in (
        "refcache.format_version", "refcache.model_hash", "refcache.tokenizer_hash", "refcache.mask_checksum",
        "refcache.encoding")} == {
        "refcache.format_version": "1", "refcache.model_hash": MODEL_HASH, "refcache.tokenizer_hash": TOKENIZER_HASH,
        "refcache.mask_checksum": shard_sum, "refcache.encoding": ENC.to_json()}
    assert read_shard_metadata(path)["encoding"] == ENC.to_json()

    assert entry == {"file": path.name, "rows": 5, "bytes": path.stat().st_size,
                     "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "mask_checksum": shard_sum,
                     "ids_checksum": ids_checksum([r["id"] for r in rows])}
    assert raw[b"refcache.ids_checksum"].decode() == entry["ids_checksum"]
    assert json.loads(raw[b"refcache.computation"]) == COMP
    assert pq.ParquetFile(path).metadata.row_group(0).column(1).compression == "ZSTD"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left behind
    assert os.stat(path).st_size > 0


def test_sums_are_of_the_stored_float32_values(tmp_path):
    # float64 inputs are stored as float32; the sum must be of what is stored, not of the unrounded inputs.
    values = [0.1, -1.0 / 3.0, -2.7182818284590452, -1e-8]
    table = shard_table(["a"], [[1, 5]], [[6, 7, 8, 2]], [[9, 2]], [values], [[-0.5, -0.25]])
    stored = np.asarray(values, np.float32)
    assert table.column("chosen_logps").to_pylist()[0] == stored.tolist()
    assert table.column("chosen_logp").to_pylist()[0] == float(np.sum(stored.astype(np.float64)))
    assert table.column("chosen_logp").to_pylist()[0] != float(np.sum(np.asarray(values, np.float64)))
    assert table.column("rejected_logp").to_pylist() == [-0.75]
    assert table.schema.field("chosen_logp").type == pa.float64()


def test_same_table_writes_identical_bytes(tmp_path, encoded):
    table = table_of(encoded[:4])
    a = write_shard(tmp_path / "a.parquet", table, model_hash=MODEL_HASH, tokenizer_hash=TOKENIZER_HASH, encoding=ENC,
                    computation=COMP)
    b = write_shard(tmp_path / "b.parquet", table_of(encoded[:4]), model_hash=MODEL_HASH,
                    tokenizer_hash=TOKENIZER_HASH, encoding=ENC, computation=COMP)
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    assert {**a, "file": None} == {**b, "file": None}
    c = write_shard(tmp_path / "c.parquet", table, model_hash=TOKENIZER_HASH, tokenizer_hash=TOKENIZER_HASH,
                    encoding=ENC, computation=COMP)
    assert c["sha256"] != a["sha256"]  # the stamps are in the file


def test_manifest_is_written_atomically_and_canonically(tmp_path):
    write_manifest(tmp_path, {"b": 1, "a": [1, 2]})
    text = (tmp_path / MANIFEST).read_text()
    assert text == json.dumps({"a": [1, 2], "b": 1}, indent=2, sort_keys=True) + "\n"
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST]


# ---------------------------------------------------------------------------------------------------------------
# a whole cache


def test_complete_cache_opens(pristine, encoded):
    for verify in (True, False):
        cache = open_cache(pristine, verify_files=verify)
        assert isinstance(cache, Cache)
        assert cache.encoding == ENC
        assert cache.stamps == {"model_hash": MODEL_HASH, "tokenizer_hash": TOKENIZER_HASH,
                                "mask_checksum": combined_mask_checksum([r["checksum"] for r in encoded],
                                                                        ENC.to_json())}
        assert [p.name for p in cache.shard_paths] == [f"shard-{i:05d}.parquet" for i in range(SHARDS)]
        table = cache.scan()
        assert table.column("id").to_pylist() == [r["id"] for r in encoded]
        assert table.column("chosen_logps").to_pylist() == [r["chosen_logps"] for r in encoded]
        assert table.column("row").to_pylist() == [i % ROWS_PER_SHARD for i in range(len(encoded))]
        assert cache.scan(["chosen_logp"]).column_names == ["chosen_logp", "id", "mask_checksum", "shard", "row"]


def test_format_md_snippet_reads_a_cache(pristine, encoded):
    """The snippet in FORMAT.md reads a cache with polars and pyarrow alone."""
    import re

    import polars as pl

    doc = (REPO / "schemas" / "FORMAT.md").read_text()
    (snippet,) = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert len(snippet.strip().splitlines()) == 5
    ns = {}
    exec(snippet.replace('"ref-cache"', repr(str(pristine))), ns)
    df, meta = ns["df"], ns["meta"]
    assert df["id"].to_list() == [r["id"] for r in encoded]
    assert df["chosen_logp"].dtype == pl.Float64 and df["chosen_logps"].dtype == pl.List(pl.Float32)
    assert df["prompt_input_ids"].dtype == pl.List(pl.Int32)
    assert meta[b"refcache.model_hash"].decode() == MODEL_HASH
    assert meta[b"refcache.format_version"] == b"1"


# ---------------------------------------------------------------------------------------------------------------
# the verifier's refusals


def test_missing_manifest_is_incomplete(cache_dir):
    (cache_dir / MANIFEST).unlink()
    e = refused(cache_dir, "incomplete")
    assert "resume" in e.remedy
    assert "holds no cache (no such folder)" in refused(cache_dir / "nowhere", "no_cache").message


def test_a_dangling_symlink_given_as_the_cache_is_named_with_its_target(cache_dir, tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    message = refused(tmp_path / "link", "no_cache").message
    assert "a symbolic link to" in message and str(tmp_path / "gone") in message and "a file" not in message


@pytest.mark.parametrize("text", ["{\"format_version\": 1, ", "", "\xff\xfe", "[1, 2]", "{\"format_version\": \"1\"}",
                                  "{\"format_version\": true}"])
def test_malformed_manifest(cache_dir, text):
    (cache_dir / MANIFEST).write_bytes(text.encode("latin-1"))
    refused(cache_dir, "manifest")


@pytest.mark.parametrize("edit", [
    lambda m: m.pop("stamps"),
    lambda m: m["stamps"].pop("mask_checksum"),
    lambda m: m.update(shards={"file": "x"}),
    lambda m: m["shards"][0].pop("sha256"),
    lambda m: m["encoding"].update(max_length=1),
    lambda m: m["encoding"].update(padding="left"),
])
def test_manifest_missing_fields(cache_dir, edit):
    m = manifest_of(cache_dir)
    edit(m)
    write_manifest(cache_dir, m)
    refused(cache_dir, "manifest")


def test_future_format_version(cache_dir):
    m = manifest_of(cache_dir)
    m["format_version"] = FORMAT_VERSION + 1
    m["software"] = {**m.get("software", {}), "refcache": "99.0"}  # as a newer refcache writes it
    write_manifest(cache_dir, m)
    e = refused(cache_dir, "format_version")
    assert (e.expected, e.found) == (1, 2) and "upgrade refcache" in e.remedy


@pytest.mark.parametrize("version", [0, -1, FORMAT_VERSION + 98])
def test_edited_format_version_is_a_damaged_manifest(cache_dir, version):
    """A format version no refcache writes (below 1), or a newer one in a manifest that names this refcache as its
    writer, is an edited manifest: said so, with the command that makes the cache again, never "upgrade refcache"."""
    m = manifest_of(cache_dir)
    m["format_version"] = version
    m["software"] = {**m.get("software", {}), "refcache": version_of("refcache")}
    write_manifest(cache_dir, m)
    e = refused(cache_dir, "format_version")
    assert "the manifest is damaged" in e.message and "upgrade" not in e.remedy, e
    assert f"--out {cache_dir} --overwrite`" in e.remedy and e.remedy.startswith("the cache is damaged"), e.remedy


@pytest.mark.parametrize("name", ["../shard-00000.parquet", "sub/shard-00000.parquet", "/tmp/shard-00000.parquet",
                                  ".hidden.parquet", "shard-00000.csv", 7])
def test_shard_name_leaving_the_directory(cache_dir, name):
    m = manifest_of(cache_dir)
    m["shards"][0]["file"] = name
    write_manifest(cache_dir, m)
    refused(cache_dir, "shard_path")


def test_symlinked_shard_leaving_the_directory(cache_dir, tmp_path):
    name = "shard-00001.parquet"
    outside = tmp_path / "elsewhere.parquet"
    shutil.move(cache_dir / name, outside)
    (cache_dir / name).symlink_to(outside)  # same bytes, so size and hash would pass
    e = refused(cache_dir, "shard_path")
    assert e.shard == name and str(outside) in str(e)


def test_symlink_inside_the_directory_is_accepted(pristine, cache_dir, encoded):
    from schemas import read_cache

    name = "shard-00001.parquet"
    shutil.move(cache_dir / name, cache_dir / "real-00001.bin")
    (cache_dir / name).symlink_to("real-00001.bin")
    rows = read_cache(cache_dir).collect()  # opened (a refusal would raise) and read through the link
    assert rows.equals(read_cache(pristine).collect()) and rows.height == len(encoded)


def test_listed_shard_deleted(cache_dir):
    (cache_dir / "shard-00002.parquet").unlink()
    assert refused(cache_dir, "shard_missing").shard == "shard-00002.parquet"


def test_unlisted_shard(cache_dir):
    shutil.copy(cache_dir / "shard-00000.parquet", cache_dir / "shard-00099.parquet")
    assert refused(cache_dir, "shard_unlisted").shard == "shard-00099.parquet"
    # files a writer leaves in passing are not shards
    (cache_dir / "shard-00099.parquet").unlink()
    (cache_dir / ".shard-00003.parquet.tmp-123").write_bytes(b"partial")
    open_cache(cache_dir)


def test_flipped_byte(cache_dir):
    path = cache_dir / "shard-00001.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))  # same size
    e = refused(cache_dir, "shard_hash")
    assert e.shard == path.name and e.expected == manifest_of(cache_dir)["shards"][1]["sha256"]
    assert e.found == hashlib.sha256(bytes(data)).hexdigest()


def test_truncated_shard(cache_dir):
    path = cache_dir / "shard-00000.parquet"
    size = path.stat().st_size
    os.truncate(path, size - 100)
    e = refused(cache_dir, "shard_size")
    assert (e.expected, e.found, e.shard) == (size, size - 100, path.name)


def _rewrite_shard(root: Path, name: str, table: pa.Table = None, **meta_edits) -> None:
    path = root / name
    table = pq.read_table(path) if table is None else table
    meta = dict(pq.read_schema(path).metadata)
    for k, v in meta_edits.items():
        meta[f"refcache.{k}".encode()] = v.encode()
    pq.write_table(table.replace_schema_metadata(meta), path, compression="zstd")
    refresh_entry(root, name)


@pytest.mark.parametrize("stamp", ["model_hash", "tokenizer_hash", "mask_checksum"])
def test_shard_metadata_stamp_edited(cache_dir, stamp):
    name = "shard-00001.parquet"
    forged = hashlib.sha256(b"forged").hexdigest()
    _rewrite_shard(cache_dir, name, **{stamp: forged})
    e = refused(cache_dir, stamp, StampMismatch)
    assert e.found == forged and e.shard == name
    assert e.expected == (manifest_of(cache_dir)["shards"][1]["mask_checksum"] if stamp == "mask_checksum"
                          else manifest_of(cache_dir)["stamps"][stamp])


@pytest.mark.parametrize("key,value", [("encoding", EncodingConfig(max_length=97).to_json()), ("format_version", "2")])
def test_shard_metadata_other_key_edited(cache_dir, key, value):
    _rewrite_shard(cache_dir, "shard-00002.parquet", **{key: value})
    e = refused(cache_dir, "shard_metadata", StampMismatch)
    assert e.found == value


def test_rows_reordered_inside_a_shard(cache_dir):
    name = "shard-00001.parquet"
    table = pq.read_table(cache_dir / name)
    reordered = table.take(list(range(table.num_rows))[::-1])
    _rewrite_shard(cache_dir, name, reordered)  # metadata kept, file size and hash in the manifest made to match
    e = refused(cache_dir, "mask_checksum", StampMismatch)
    assert e.shard == name and e.expected == manifest_of(cache_dir)["shards"][1]["mask_checksum"]


def test_shards_listed_in_another_order(cache_dir):
    m = manifest_of(cache_dir)
    m["shards"].reverse()  # each shard is consistent with its entry; together they no longer add up
    write_manifest(cache_dir, m)
    e = refused(cache_dir, "mask_checksum", StampMismatch)
    assert e.shard is None and e.expected == m["stamps"]["mask_checksum"]


@pytest.mark.parametrize("stamp", ["model_hash", "tokenizer_hash", "mask_checksum"])
def test_manifest_stamp_edited(cache_dir, stamp):
    m = manifest_of(cache_dir)
    m["stamps"][stamp] = hashlib.sha256(b"edited").hexdigest()
    write_manifest(cache_dir, m)
    e = refused(cache_dir, stamp, StampMismatch)
    assert m["stamps"][stamp] in (e.expected, e.found)


def test_manifest_row_count_edited(cache_dir):
    m = manifest_of(cache_dir)
    m["shards"][0]["rows"] += 1
    write_manifest(cache_dir, m)
    e = refused(cache_dir, "shard_rows")
    assert (e.expected, e.found) == (ROWS_PER_SHARD + 1, ROWS_PER_SHARD)


def test_unreadable_shard(cache_dir):
    name = "shard-00000.parquet"
    (cache_dir / name).write_bytes(b"not parquet at all" * 10)
    refresh_entry(cache_dir, name)
    refused(cache_dir, "shard_unreadable")


def test_duplicate_row_id(tmp_path, encoded):
    rows = encoded[:4] + [{**encoded[4], "id": encoded[0]["id"]}] + encoded[5:8]
    write_cache(tmp_path / "cache", rows, shards=2)
    e = refused(tmp_path / "cache", "duplicate_id")
    assert (e.shard, e.row) == ("shard-00001.parquet", 0)


# ---------------------------------------------------------------------------------------------------------------
# issue 16 (what a TRL user expects), item 13: the cache read by a glob (the README's one-liners) and by schemas.read_cache


def test_cache_one_liners(dpo_cache):
    import pandas as pd
    import polars as pl

    from schemas import read_cache

    manifest = json.loads((dpo_cache / "manifest.json").read_text())
    ids = read_cache(dpo_cache).select("id").collect()["id"].to_list()
    assert len(ids) == manifest["rows"] == 40
    shards = [str(dpo_cache / s["file"]) for s in manifest["shards"]]  # the README's way: the manifest's shards
    assert pl.scan_parquet(shards).select("id").collect()["id"].to_list() == ids
    assert pd.read_parquet(shards)["id"].to_list() == ids
