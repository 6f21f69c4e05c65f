"""A cache on a store whose fsspec driver exposes no conditional write (what gcsfs and adlfs are to refcache), played
by fsspec's in-memory filesystem (`memory://`, this process only): the same commands and rules, the manifest and the
lease checked just before each write (storage/writes.py `put_if`; FORMAT.md, "Object storage")."""

from __future__ import annotations

import json
import time

import pytest

from conftest import pref_rows, write_jsonl
from faultkit import precompute
from schemas import format as fmt
from storage import faults, lease, places, writes
from schemas.cache import open_cache, read_cache
from schemas.findings import CacheError

ROWS, PER_SHARD = 12, 5


@pytest.fixture()
def memory():
    import fsspec

    fs = fsspec.filesystem("memory")
    yield fs
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]


@pytest.fixture(scope="module")
def job(tmp_path_factory, llama_dir):
    base = tmp_path_factory.mktemp("generic")
    data = write_jsonl(base / "prefs.jsonl", pref_rows(ROWS, seed=47))
    args = ["--model", llama_dir, "--data", data, "--rows-per-shard", PER_SHARD]
    assert precompute(*args, "--out", base / "clean").exit_code == 0
    return {"args": args, "clean": base / "clean"}


def test_precompute_and_read_without_conditional_writes(memory, job):
    url = "memory://bucket/cache"
    r = precompute(*job["args"], "--out", url)
    assert r.exit_code == 0, r.output
    assert places.location(url)._s.protocol not in writes.CONDITIONAL
    a, b = read_cache(url).collect(), read_cache(job["clean"]).collect()
    assert a.height == ROWS and a.equals(b)
    assert not memory.exists("/bucket/cache/" + fmt.LOCK)  # the lease released
    again = precompute(*job["args"], "--out", url)
    assert again.exit_code == 0 and "0 scored now" in again.output, again.output

    memory.pipe_file("/bucket/cache/shard-00001.parquet", b"PAR1 not this shard")
    with pytest.raises(CacheError) as e:
        open_cache(url)
    assert e.value.kind in ("shard_size", "shard_hash")


def test_lease_and_manifest_checked_before_writing(memory, job):
    url = "memory://bucket/other"
    lock = "/bucket/other/" + fmt.LOCK
    memory.pipe_file(lock, json.dumps({"host": "elsewhere", "pid": 3, "expires": time.time() + 600}).encode())
    r = precompute(*job["args"], "--out", url)
    assert r.exit_code == 2 and "pid 3 on elsewhere" in r.output, r.output
    memory.pipe_file(lock, json.dumps({"host": "elsewhere", "pid": 3, "expires": time.time() - 1}).encode())
    with lease.lease(places.location(url), fmt.LOCK):  # expired: taken over
        assert json.loads(memory.cat_file(lock))["host"] != "elsewhere"

    root = places.location(url)
    assert not (root / fmt.MANIFEST).exists()
    memory.pipe_file("/bucket/other/" + fmt.MANIFEST, b"{}")  # another writer's, after this one looked
    with pytest.raises(writes.StoreConflict):
        fmt.write_manifest(root, fmt.read_manifest(job["clean"]))
    assert memory.cat_file("/bucket/other/" + fmt.MANIFEST) == b"{}"


def test_a_url_where_only_a_local_path_is_taken_is_refused_never_made_a_folder(job, llama_dir, tmp_path,
                                                                                monkeypatch):
    """Outputs other than precompute-ref's --out are local: a URL there (train-dpo --output-dir, an offload folder)
    is refused when the command line is parsed (runtime.locations.Location), not taken for a local folder named `s3:`."""
    from faultkit import TRAIN, train

    monkeypatch.chdir(tmp_path)
    t = train("--model", llama_dir, "--data", job["args"][3], "--ref-cache", job["clean"],
              "--output-dir", "s3://bucket/runs/dpo-1", *TRAIN)
    assert t.exit_code == 2 and "'--output-dir' / '--output_dir': s3://bucket/runs/dpo-1: an object-store URL" in \
        t.output, t.output
    p = precompute(*job["args"], "--out", tmp_path / "c", "--device-map", "auto", "--max-memory", "1GiB",
                   "--offload-folder", "s3://bucket/offload")
    assert p.exit_code == 2 and "'--offload-folder'" in p.output, p.output
    assert "s3://bucket/offload: an object-store URL" in p.output, p.output
    assert list(tmp_path.iterdir()) == []  # no `s3:` folder, no cache begun


def test_no_credentials_at_all_is_a_store_fault_with_its_remedy_by_type_not_text():
    """botocore's NoCredentialsError (and google-auth's, azure-identity's by class name): exit 2 naming what to give,
    not an unexpected error; classified anywhere in the error's chain."""
    for name in sorted(faults.NO_CREDENTIALS):
        error = type(name, (Exception,), {})("Unable to locate credentials")
        fault = faults.store_fault("s3://b/p", "s3", error)
        assert fault is not None and fault.kind == "no_credentials" and "s3://b/p" in str(fault), name
        assert "remedy:" in str(fault) and "credentials" in fault.remedy


def test_an_s3_cache_or_out_without_credentials_exits_2_naming_them(job, tmp_path, llama_dir, monkeypatch):
    """train-dpo --ref-cache s3://, precompute-ref --out s3:// and audit-ref s3:// on a machine with no AWS
    credentials anywhere (environment, files, instance metadata): one paragraph, exit 2, no traceback."""
    s3fs = pytest.importorskip("s3fs")
    from faultkit import TRAIN, invoke, train

    from audit.cli import main as audit_main

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    url = "s3://refcache-no-credentials/cache"
    try:
        results = {"train-dpo": train("--model", llama_dir, "--data", job["args"][3], "--ref-cache", url,
                                      "--output-dir", tmp_path / "run", *TRAIN),
                   "precompute-ref": precompute(*job["args"], "--out", url),
                   "audit-ref": invoke(audit_main, [url])}
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    for command, r in results.items():
        assert r.exit_code == 2, (command, r.output)
        assert "no credentials for the store" in r.output and url in r.output, (command, r.output)
        assert "unexpected" not in r.output and "Traceback" not in r.output, (command, r.output)
