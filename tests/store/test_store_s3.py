"""Caches on an object store (storage/places.py, reads.py, writes.py, lease.py), against a real S3 server: moto's, started here on 127.0.0.1 with
dummy credentials and AWS_ENDPOINT_URL in the environment (what botocore and s3fs read; nothing of ours).

precompute-ref --out s3://, read_cache, train-dpo --ref-cache s3:// and audit-ref on s3:// give what they give on a
local folder (value by value); a prefix without a manifest, a tampered object and a replaced shard are refused as
locally; one writer per prefix (a lease object: a second writer is refused naming the holder, the lease of a killed
writer is taken over); a writer killed mid-shard or between shards leaves nothing a reader accepts, and the same
command resumes to the clean cache; the manifest is written only if absent or unchanged since the writer read it."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from conftest import pref_rows, write_jsonl
from faultkit import TRAIN, audit, launch, precompute, train, wait_for
from schemas import format as fmt
from storage import faults, lease, places, reads, writes
from schemas.cache import open_cache, read_cache
from schemas.findings import CacheError

ROWS, PER_SHARD = 24, 6  # four shards
BUCKET = "refcache-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3():
    """A moto S3 server on loopback for the session; the environment points botocore at it (subprocesses inherit it)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                                            "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN", "AWS_PROFILE")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    os.environ.pop("AWS_SESSION_TOKEN", None)
    os.environ.pop("AWS_PROFILE", None)
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(BUCKET)
    yield fs
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


_n = iter(range(10**6))


@pytest.fixture()
def prefix(s3):
    """A fresh prefix of the bucket, as a URL."""
    return f"s3://{BUCKET}/t{next(_n)}-{os.getpid()}/cache"


@pytest.fixture(scope="module")
def job(tmp_path_factory, llama_dir):
    """The data, the options, and the clean local cache every store cache is compared with."""
    base = tmp_path_factory.mktemp("store")
    data = write_jsonl(base / "prefs.jsonl", pref_rows(ROWS, seed=43))
    args = ["--model", llama_dir, "--data", data, "--rows-per-shard", PER_SHARD]
    clean = base / "clean"
    r = precompute(*args, "--out", clean)
    assert r.exit_code == 0, r.output
    return {"base": base, "data": data, "args": args, "clean": clean}


def upload(s3, local, url, skip=()):
    for p in sorted(local.iterdir()):
        if p.is_file() and p.name not in skip and p.name != fmt.LOCK:
            s3.put_file(str(p), f"{url.removeprefix('s3://')}/{p.name}")


def keys(s3, url) -> set[str]:
    s3.invalidate_cache()
    try:
        return {k.rsplit("/", 1)[-1] for k in s3.ls(url.removeprefix("s3://"))}
    except FileNotFoundError:
        return set()


def same_values(url, local):
    """read_cache on the store equals read_cache on the folder, value by value, row order included."""
    a, b = read_cache(url).collect(), read_cache(local).collect()
    assert a.columns == b.columns and a.height == b.height == ROWS
    assert a.equals(b)


def shard_entries(manifest: dict) -> list[tuple]:
    return [(e["file"], e["rows"], e["bytes"], e["sha256"], e["mask_checksum"]) for e in manifest["shards"]]


# ---------------------------------------------------------------------------------------------------------------
# the three commands and the reader on s3://


def test_precompute_read_train_audit_on_s3(s3, job, prefix, tmp_path, llama_dir):
    r = precompute(*job["args"], "--out", prefix)
    assert r.exit_code == 0, r.output
    assert keys(s3, prefix) == {"manifest.json", "README.md", *[f"shard-{i:05d}.parquet" for i in range(4)]}
    there = json.loads(s3.cat_file(f"{prefix.removeprefix('s3://')}/manifest.json"))
    local = fmt.read_manifest(job["clean"])
    assert shard_entries(there) == shard_entries(local)  # the same bytes, shard for shard
    assert there["stamps"] == local["stamps"]
    same_values(prefix, job["clean"])

    cache = open_cache(prefix)
    assert isinstance(cache.root, places.StorePath) and cache.index.num_rows == ROWS
    scanned = cache.scan(["chosen_logps"])
    assert scanned.column("chosen_logps").to_pylist() == open_cache(job["clean"]).scan(
        ["chosen_logps"]).column("chosen_logps").to_pylist()

    again = precompute(*job["args"], "--out", prefix)  # a rerun finds everything there and writes nothing
    assert again.exit_code == 0 and "0 scored now" in again.output, again.output

    code, report, output = audit_on(prefix, tmp_path)
    assert code == 0 and report["result"] == "PASS", output
    assert report["cache"] == prefix

    out = tmp_path / "run"
    t = train("--model", llama_dir, "--data", job["data"], "--ref-cache", prefix, "--output-dir", out, *TRAIN)
    assert t.exit_code == 0, t.output
    assert f"verified {prefix}" in t.output and "file hashes" in t.output
    run = json.loads((out / "run-manifest.json").read_text())
    assert run["reference"]["cache"]["path"] == prefix
    # the model card names the reference model the cache names, as for a local cache (issue 34, family 10)
    assert f"| reference model | `{llama_dir}` |" in (out / "README.md").read_text()
    assert run["reference"]["cache"]["model"]["path"] == str(llama_dir)
    assert run["reference"]["cache"]["manifest_sha256"] == reads.sha256(places.location(prefix) / fmt.MANIFEST)
    code, report, output = audit_on(prefix, tmp_path, "--run", out)
    assert code == 0 and {c["name"]: c["status"] for c in report["checks"]}["run_cache"] == "PASS", output


def audit_on(url, tmp_path, *args):
    """audit-ref on a URL: (exit code, JSON report, output)."""
    return audit(url, *args, json_path=tmp_path / "audit.json")


def test_hashed_reads_each_object_once(s3, job, prefix):
    """open_cache streams a shard once: its sha256 over the bytes as they arrive, the footer, the index columns and
    the columns train-dpo will scan (keep=) from those bytes; the scan then fetches nothing."""
    from dpo.verify import scanned_columns

    upload(s3, job["clean"], prefix)
    opened = []
    real = s3.__class__.open

    def counting(self, path, mode="rb", **kw):
        opened.append(path.rsplit("/", 1)[-1])
        return real(self, path, mode, **kw)

    s3.__class__.open = counting
    try:
        cache = open_cache(prefix, keep=scanned_columns)
        shards = sorted(g for g in opened if g.endswith(".parquet"))
        assert shards == [f"shard-{i:05d}.parquet" for i in range(4)], opened  # one open per shard
        opened.clear()
        table = cache.scan(scanned_columns(cache.manifest))
        assert opened == []  # from the verified bytes
    finally:
        s3.__class__.open = real
    local = open_cache(job["clean"])
    assert table.equals(local.scan(scanned_columns(local.manifest)))


def test_scan_fetches_only_the_columns_asked_for(s3, job, prefix, tmp_path, llama_dir):
    """After the open, a column is read by ranged requests for its chunks: a small column costs a small part of the
    shards' bytes (with --fast-verify nothing is fetched whole). One shard larger than the 64 KiB pyarrow reads for
    a footer."""
    import s3fs

    big = tmp_path / "big"
    data = write_jsonl(tmp_path / "big.jsonl", pref_rows(1400, seed=5))
    r = precompute("--model", llama_dir, "--data", data, "--rows-per-shard", 1400, "--out", big)
    assert r.exit_code == 0, r.output
    upload(s3, big, prefix)
    total = sum(e["bytes"] for e in fmt.read_manifest(big)["shards"])
    assert total > 3 * 2**16
    fetched = []
    real = s3fs.core.S3File._fetch_range

    def counting(self, start, end):
        data = real(self, start, end)
        fetched.append(len(data))
        return data

    cache = open_cache(prefix, verify_files=False)
    s3fs.core.S3File._fetch_range = counting
    try:
        table = cache.scan(["chosen_logp"])
    finally:
        s3fs.core.S3File._fetch_range = real
    assert table.column("chosen_logp").to_pylist() == open_cache(big).scan(
        ["chosen_logp"]).column("chosen_logp").to_pylist()
    assert 0 < sum(fetched) < total / 2, (sum(fetched), total)


# ---------------------------------------------------------------------------------------------------------------
# what a reader refuses


def test_prefix_without_manifest_is_refused(s3, job, prefix):
    with pytest.raises(CacheError) as e:
        open_cache(prefix)  # nothing there: not an interrupted writer's
    assert e.value.kind == "no_cache" and "holds no cache" in e.value.message
    upload(s3, job["clean"], prefix, skip={fmt.MANIFEST})  # every shard, complete, but no manifest
    with pytest.raises(CacheError) as e:
        read_cache(prefix)
    assert e.value.kind == "incomplete" and "manifest.json" in e.value.message


@pytest.mark.parametrize("damage", ["byte_flipped", "shard_replaced"])
def test_tampered_object_is_refused(s3, job, prefix, tmp_path, damage):
    upload(s3, job["clean"], prefix)
    key = f"{prefix.removeprefix('s3://')}/shard-00001.parquet"
    if damage == "byte_flipped":
        data = bytearray(s3.cat_file(key))
        data[len(data) // 2] ^= 0x01
    else:  # another shard of the same cache under this name: size differs or content does
        data = bytearray(s3.cat_file(f"{prefix.removeprefix('s3://')}/shard-00002.parquet"))
    s3.pipe_file(key, bytes(data))
    with pytest.raises(CacheError) as e:
        open_cache(prefix)
    assert e.value.kind in ("shard_hash", "shard_size") and e.value.shard == "shard-00001.parquet"
    code, report, output = audit_on(prefix, tmp_path)
    assert code == 1 and "shard_files" in report["failed"], output


# ---------------------------------------------------------------------------------------------------------------
# writers


def test_second_writer_is_refused_naming_the_holder(s3, job, prefix, tmp_path):
    marker, go = tmp_path / "reached", tmp_path / "go"
    first = launch("precompute-ref", [*job["args"], "--out", prefix, "--no-progress"], at="first_shard",
                   action="pause", marker=marker, go=go)
    try:
        wait_for(marker, first)
        second = precompute(*job["args"], "--out", prefix)
        assert second.exit_code == 2, second.output
        assert f"pid {first.pid}" in second.output and "being written by another precompute-ref" in second.output
        go.write_text("")
        assert first.wait(timeout=300) == 0, first.stderr.read()
    finally:
        first.kill()
    assert fmt.LOCK not in keys(s3, prefix)  # released at the end
    same_values(prefix, job["clean"])


SHARDS = [f"shard-{i:05d}.parquet" for i in range(ROWS // PER_SHARD)]
# fault (tests/helpers/fault_launcher.py) -> (shard objects complete when killed, the object being written or None)
KILLS = {
    "shard_write": (SHARDS[:1], "shard-00001.parquet"),  # half of shard 1 in the local temporary file
    "shard_renamed": (SHARDS[:2], None),  # shard 1 uploaded, nothing after it
    "manifest_write": (SHARDS, "manifest.json"),  # every shard uploaded, half the manifest in the temporary file
}


@pytest.mark.parametrize("at", list(KILLS))
def test_writer_killed_then_resumed(s3, job, prefix, tmp_path, at):
    """kill -9 inside a shard's write, right after a shard's upload, or inside the manifest's write: nothing a reader
    accepts, the lease of the dead writer left behind; the same command takes the lease over, keeps the finished
    shards and ends with the clean cache."""
    done, writing = KILLS[at]
    killed = launch("precompute-ref", [*job["args"], "--out", prefix, "--no-progress"], at=at, shard=1)
    killed.wait(timeout=300)
    assert killed.returncode == -9, killed.stderr.read()
    assert keys(s3, prefix) == {*done, fmt.LOCK}  # no partial object, no manifest
    holder = json.loads(s3.cat_file(f"{prefix.removeprefix('s3://')}/{fmt.LOCK}"))
    assert holder["pid"] == killed.pid and holder["host"] == socket.gethostname()
    with pytest.raises(CacheError) as e:
        open_cache(prefix)
    assert e.value.kind == "incomplete"
    left = list(Path(tempfile.gettempdir()).glob(f"refcache-upload-{killed.pid}-*"))
    assert [p.name.rsplit("-", 1)[-1] for p in left] == ([writing.rsplit("-", 1)[-1]] if writing else [])
    r = precompute(*job["args"], "--out", prefix)
    assert r.exit_code == 0, r.output
    assert not any(p.exists() for p in left)  # the killed writer's temporary file, removed by the next writer
    assert f"({ROWS - PER_SHARD * len(done)} scored now)" in r.output, r.output
    assert shard_entries(fmt.read_manifest(places.location(prefix))) == shard_entries(fmt.read_manifest(job["clean"]))
    same_values(prefix, job["clean"])


def test_overwrite_on_s3(s3, job, prefix):
    """--overwrite deletes the cache's own objects (the manifest first) and writes the cache again."""
    assert precompute(*job["args"], "--out", prefix).exit_code == 0
    r = precompute(*job["args"], "--out", prefix, "--overwrite")
    assert r.exit_code == 0 and f"({ROWS} scored now)" in r.output, r.output
    same_values(prefix, job["clean"])


def test_foreign_object_refused_and_kept(s3, job, prefix):
    s3.pipe_file(f"{prefix.removeprefix('s3://')}/notes.txt", b"mine")
    r = precompute(*job["args"], "--out", prefix)
    assert r.exit_code == 2 and "notes.txt" in r.output and "nothing was written or deleted" in r.output, r.output
    assert keys(s3, prefix) == {"notes.txt"}


def test_live_lease_of_another_host_refused_and_expired_one_taken_over(s3, prefix):
    root = places.location(prefix)
    lock = f"{prefix.removeprefix('s3://')}/{fmt.LOCK}"
    s3.pipe_file(lock, json.dumps({"host": "elsewhere", "pid": 1, "expires": time.time() + 600}).encode())
    with pytest.raises(lease.LeaseHeld) as e:
        with lease.lease(root, fmt.LOCK):
            pass
    assert "pid 1 on elsewhere" in str(e.value)
    s3.pipe_file(lock, json.dumps({"host": "elsewhere", "pid": 1, "expires": time.time() - 1}).encode())
    with lease.lease(root, fmt.LOCK):
        held = json.loads(s3.cat_file(lock))
        assert held["pid"] == os.getpid() and held["expires"] > time.time()
    s3.invalidate_cache()
    assert not s3.exists(lock)  # released


def test_writer_that_lost_its_lease_writes_no_manifest(s3, job, prefix, monkeypatch):
    """A writer whose lease was taken over (it stalled past the term) finds out at its next refresh and then writes no
    manifest."""
    monkeypatch.setattr(lease, "LEASE_S", 0.2)  # refreshed every 0.05 s
    root = places.location(prefix)
    lock = f"{prefix.removeprefix('s3://')}/{fmt.LOCK}"
    with lease.lease(root, fmt.LOCK) as held:
        s3.pipe_file(lock, json.dumps({"host": "elsewhere", "pid": 7, "expires": time.time() + 600}).encode())
        deadline = time.monotonic() + 120  # a bound on a wait, generous for a loaded machine
        while held.lost is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert held.lost is not None
        with pytest.raises(writes.StoreConflict, match="lost its lease"):
            fmt.write_manifest(root, fmt.read_manifest(job["clean"]))
    assert json.loads(s3.cat_file(lock))["host"] == "elsewhere"  # the other writer's lease is not released by us
    s3.invalidate_cache()
    assert not s3.exists(f"{prefix.removeprefix('s3://')}/{fmt.MANIFEST}")


def test_manifest_written_only_if_unchanged_since_read(s3, job, prefix):
    """A writer that saw no manifest does not overwrite one another writer made meanwhile (If-None-Match: *); one
    that read a manifest does not overwrite a changed one (If-Match)."""
    upload(s3, job["clean"], prefix, skip={fmt.MANIFEST})
    manifest = fmt.read_manifest(job["clean"])
    root = places.location(prefix)
    assert not (root / fmt.MANIFEST).exists()  # this writer saw none
    s3.pipe_file(f"{prefix.removeprefix('s3://')}/{fmt.MANIFEST}", b'{"another": "writer"}')
    with pytest.raises(writes.StoreConflict, match="created by another writer"):
        fmt.write_manifest(root, manifest)
    assert json.loads(s3.cat_file(f"{prefix.removeprefix('s3://')}/{fmt.MANIFEST}")) == {"another": "writer"}

    reader = places.location(prefix)
    (reader / fmt.MANIFEST).read_bytes()  # this writer read it
    fmt.write_manifest(reader, manifest)  # unchanged since: written
    assert fmt.read_manifest(places.location(prefix))["stamps"] == manifest["stamps"]
    s3.pipe_file(f"{prefix.removeprefix('s3://')}/{fmt.MANIFEST}", b'{"changed": 1}')
    with pytest.raises(writes.StoreConflict, match="changed by another writer"):
        fmt.write_manifest(reader, {**manifest, "rows": 0})


def test_update_on_s3_equals_the_same_update_on_a_folder(s3, job, prefix, tmp_path):
    """precompute-ref --update on s3:// (issue 28's incremental caches on a store): the grown data's new rows scored
    into new objects, the old manifest kept as a version object, and the same manifest and values as the same
    update of a local copy of the cache."""
    import shutil

    local = tmp_path / "local"
    shutil.copytree(job["clean"], local)
    upload(s3, job["clean"], prefix)
    grown = write_jsonl(tmp_path / "grown.jsonl", pref_rows(ROWS + 3, seed=43))
    args = [a if a != job["data"] else grown for a in job["args"]]
    for out in (local, prefix):
        r = precompute(*args, "--out", out, "--update")
        assert r.exit_code == 0, r.output
        assert "3 scored now" in r.output, r.output
    there = json.loads(s3.cat_file(f"{prefix.removeprefix('s3://')}/manifest.json"))
    here = fmt.read_manifest(local)
    assert there["version"] == here["version"] == 2
    assert there["update"] == here["update"] and len(here["update"]["added"]) == 3
    assert shard_entries(there) == shard_entries(here)
    assert "manifest-00001.json" in keys(s3, prefix)
    assert read_cache(prefix).collect().equals(read_cache(local).collect())


# ---------------------------------------------------------------------------------------------------------------
# the store itself at fault: named with its cause and remedy (exit 2), never as another writer or a crash


def _all_three(job, url, tmp_path, llama_dir):
    """train-dpo --ref-cache, audit-ref, then precompute-ref --out on `url`: their results."""
    t = train("--model", llama_dir, "--data", job["data"], "--ref-cache", url, "--output-dir", tmp_path / "run",
              *TRAIN)
    code, report, output = audit_on(url, tmp_path)
    p = precompute(*job["args"], "--out", url)
    return {"precompute-ref": (p.exit_code, p.output), "train-dpo": (t.exit_code, t.output),
            "audit-ref": (code, output)}


def test_missing_bucket_is_named_by_every_command(s3, job, tmp_path, llama_dir):
    url = f"s3://no-such-bucket-{os.getpid()}/cache"
    for command, (code, output) in _all_three(job, url, tmp_path, llama_dir).items():
        assert code == 2, (command, output)
        assert "the bucket 'no-such-bucket-" in output and "does not exist" in output, (command, output)
        assert "create the bucket" in output and "another" not in output and "interrupted" not in output
        assert "unexpected" not in output and "Traceback" not in output
    assert not (tmp_path / "run").exists()
    s3.invalidate_cache()
    assert not s3.exists(f"no-such-bucket-{os.getpid()}")  # refcache makes no bucket


def test_empty_and_mistyped_prefixes_hold_no_cache(s3, job, prefix, tmp_path, llama_dir):
    upload(s3, job["clean"], prefix)
    mistyped = prefix[:-1]  # ".../cach"
    for url, near in ((mistyped, prefix), (f"s3://{BUCKET}/qqqqqqqqqqqq", None)):
        results = _all_three(job, url, tmp_path, llama_dir)
        for command in ("train-dpo", "audit-ref"):
            code, output = results[command]
            assert code == 2 and "holds no cache" in output and "nothing is stored under this prefix" in output, output
            assert "interrupted" not in output and "still running" not in output
            assert (f"next to it: {near}" in output) if near else "next to it" not in output, output
        assert results["precompute-ref"][0] == 0  # a writer makes the prefix: nothing wrong with it
    # a prefix of other objects and no cache's: named as such
    other = f"s3://{BUCKET}/other-{os.getpid()}"
    s3.pipe_file(f"{other.removeprefix('s3://')}/notes.txt", b"mine")
    with pytest.raises(CacheError) as e:
        open_cache(other)
    assert e.value.kind == "no_cache" and "notes.txt" in e.value.message


def test_unreachable_endpoint_is_named_with_the_remedy(s3, job, tmp_path, llama_dir, monkeypatch):
    """The endpoint on a closed port of 127.0.0.1: every command says the store cannot be reached and what to check."""
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")
    s3fs.S3FileSystem.clear_instance_cache()  # a filesystem made for the live endpoint would be reused
    try:
        url = f"s3://{BUCKET}/cache"
        for command, (code, output) in _all_three(job, url, tmp_path, llama_dir).items():
            assert code == 2, (command, output)
            assert "the store cannot be reached" in output and "AWS_ENDPOINT_URL" in output, (command, output)
            assert "unexpected" not in output and "Traceback" not in output and "another" not in output
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_store_faults_are_classified_by_type_not_text():
    """store_fault looks through an error's chain: a refused connection, a name that does not resolve, a timeout, a
    refusal of access; an object that is simply absent is no store fault."""
    import socket as sockets

    def chained(outer, inner):
        try:
            try:
                raise inner
            except BaseException as e:
                raise outer from e
        except BaseException as e:
            return e

    url = "s3://b/p"
    cases = {"unreachable": [ConnectionRefusedError(111, "x"), sockets.gaierror(-2, "Name or service not known"),
                             TimeoutError("t"), chained(RuntimeError("wrapped"), ConnectionResetError(104, "r"))],
             "denied": [PermissionError("AccessDenied")]}
    for kind, errors in cases.items():
        for error in errors:
            fault = faults.store_fault(url, "s3", error)
            assert fault is not None and fault.kind == kind and url in str(fault) and "remedy:" in str(fault), error
    for error in (FileNotFoundError("no such key"), ValueError("x"), OSError(22, "Invalid argument")):
        assert faults.store_fault(url, "s3", error) is None
