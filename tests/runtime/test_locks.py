"""runtime/locks.py: one writer per output folder. A second holder is refused naming the first one's pid and the
remedy; the lock file is opened without following a symlink (one planted there is refused, its target untouched);
only a plain lock file counts as the lock."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.errors import JobError
from runtime.locks import exclusive, is_lock_file
from schemas import format as fmt
from storage.files import UnsafeDestination


def test_a_second_holder_is_refused_naming_the_first_and_the_remedy(tmp_path):
    with exclusive(tmp_path, "train-dpo", "--output-dir"):
        assert (tmp_path / fmt.LOCK).read_text() == str(os.getpid())
        with pytest.raises(JobError) as e, exclusive(tmp_path, "train-dpo", "--output-dir"):
            pass
    assert str(e.value) == (f"{tmp_path} is being written by another train-dpo process (pid {os.getpid()}); wait for "
                            "it to finish or choose another --output-dir")
    with exclusive(tmp_path, "precompute-ref", "--out"):  # released at the end of the block
        pass
    assert is_lock_file(tmp_path / fmt.LOCK)


def test_a_symlink_planted_as_the_lock_is_refused_and_its_target_kept(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("precious\n")
    out = tmp_path / "cache"
    out.mkdir()
    (out / fmt.LOCK).symlink_to(victim)
    with pytest.raises(UnsafeDestination, match=rf"{out / fmt.LOCK} is a symlink \(to {victim}\)"), \
            exclusive(out, "precompute-ref", "--out"):
        pass
    assert victim.read_text() == "precious\n" and (out / fmt.LOCK).is_symlink()
    assert not is_lock_file(out / fmt.LOCK)  # and so it counts as a file in the folder like any other


@pytest.mark.parametrize("made", ["new_folders", "empty_folder", "used_folder"])
def test_a_block_that_fails_takes_back_the_lock_and_folders_it_made(tmp_path, made):
    """A refusal (or an interruption) under the lock leaves no folder holding only `.refcache.lock` (issue 34,
    family 2): the lock file this call made and the folders it created go; what was there before, and what the
    block wrote, stay."""
    out = tmp_path / "a" / "b" / "cache"
    if made != "new_folders":
        out.mkdir(parents=True)
    if made == "used_folder":
        (out / "shard-00000.parquet").write_bytes(b"kept")
    for error in (JobError("refused"), KeyboardInterrupt()):
        with pytest.raises(type(error)), exclusive(out, "precompute-ref", "--out"):
            assert is_lock_file(out / fmt.LOCK)
            raise error
        if made == "new_folders":
            assert not (tmp_path / "a").exists()
        else:
            assert sorted(p.name for p in out.iterdir()) == (["shard-00000.parquet"] if made == "used_folder" else [])
    with exclusive(out, "precompute-ref", "--out"):  # a block that ends well keeps its lock file (no sign of use)
        pass
    assert is_lock_file(out / fmt.LOCK)
    with pytest.raises(JobError), exclusive(out, "precompute-ref", "--out"):
        raise JobError("refused")
    assert is_lock_file(out / fmt.LOCK)  # not made by this call: left as it was


def test_a_store_url_given_as_text_is_leased_not_made_a_folder(tmp_path, monkeypatch):
    import fsspec

    monkeypatch.chdir(tmp_path)
    fs = fsspec.filesystem("memory")
    with exclusive("memory://locks/cache", "precompute-ref", "--out"):
        assert fs.exists("/locks/cache/" + fmt.LOCK)
    assert not fs.exists("/locks/cache/" + fmt.LOCK) and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", [b"model: m\ndata: d\nout: o\n", b"\xff\xfe binary", b"123 and more", b"9" * 40])
def test_a_file_of_the_locks_name_that_is_not_a_lock_is_refused_and_kept(tmp_path, content):
    """Found by the hostile pass: a config named .refcache.lock inside --out was truncated to the writer's pid. Only
    an empty file or a pid is a lock to take."""
    out = tmp_path / "out"
    out.mkdir()
    (out / fmt.LOCK).write_bytes(content)
    with pytest.raises(JobError, match=r"--out .*\.refcache\.lock is not a lock file .*left as it is"):
        with exclusive(out, "precompute-ref", "--out"):
            pass
    assert (out / fmt.LOCK).read_bytes() == content
    (out / fmt.LOCK).write_text("4242\n")  # a dead writer's lock: taken over
    with exclusive(out, "precompute-ref", "--out"):
        assert (out / fmt.LOCK).read_text() == str(os.getpid())


def test_a_config_inside_out_under_the_locks_name_is_an_input_kept_apart(tmp_path):
    from click.testing import CliRunner

    from precompute.cli import main

    root = Path(__file__).resolve().parents[2] / "data"
    out = tmp_path / "o14"
    out.mkdir()
    config = out / fmt.LOCK
    text = f"model: {root / 'sft-model'}\ndata: {root / 'prefs' / 'train.jsonl'}\nout: {out}\n"
    config.write_text(text)
    result = CliRunner().invoke(main, ["--config", str(config)])
    assert result.exit_code == 2 and "--config" in result.output, result.output
    assert config.read_text() == text
