"""storage/reads.record_bytes: the one reader of record files (a cache's manifest and its versions, a run's records,
a checkpoint's trainer state, a model's config.json): a FIFO, a device, a folder or a file larger than any record is
refused without a read that waits or never ends (the hostile pass: a manifest.json FIFO blocked precompute-ref's
resume, a symlink to /dev/zero read until memory ran out, a 3 GB sparse config.json took 40 s)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from storage.reads import NotARecord, record_bytes


def test_a_record_is_read_and_anything_else_refused_without_waiting(tmp_path):
    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert record_bytes(tmp_path / "ok.json") == b'{"a": 1}'
    os.symlink(tmp_path / "ok.json", tmp_path / "link.json")
    assert record_bytes(tmp_path / "link.json") == b'{"a": 1}'  # a symlink to a file is that file
    os.mkfifo(tmp_path / "fifo.json")
    os.symlink("/dev/zero", tmp_path / "zero.json")
    (tmp_path / "folder.json").mkdir()
    with open(tmp_path / "sparse.json", "wb") as f:
        f.truncate(3 * 2**30)  # 3 GB, no block written
    for name, said in (("fifo.json", "a FIFO (named pipe), not a regular file"),
                       ("zero.json", "a device or socket, not a regular file"), ("folder.json", "a folder, not a regular file"),
                       ("sparse.json", "more than a file of this kind holds")):
        with pytest.raises(NotARecord, match=re.escape(said)):
            record_bytes(tmp_path / name)
    assert isinstance(NotARecord("x"), OSError)  # what every caller of a record already catches


def test_a_cache_whose_manifest_is_a_fifo_is_refused_not_waited_on(tmp_path, llama_dir):
    """End to end (a child process, so a wait would be a timeout here, not a hung suite): precompute-ref over --out
    whose manifest.json is a FIFO, as a resume; audit-ref of it."""
    out = tmp_path / "cache"
    out.mkdir()
    os.mkfifo(out / "manifest.json")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "why?", "chosen": "sure", "rejected": "no"}\n')
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for argv in (["precompute.cli", "--model", str(llama_dir), "--data", str(data), "--out", str(out)],
                 ["audit.cli", str(out)]):
        code = f"import sys; from {argv[0]} import main; sys.argv = ['x', *{argv[1:]!r}]; main()"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 2, done.stderr
        said = " ".join(done.stderr.split())
        assert "manifest.json" in said and ("FIFO" in said or "not a regular file" in said), said
