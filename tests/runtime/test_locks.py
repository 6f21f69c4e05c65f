"""runtime/locks.py: one writer per output folder. A second holder is refused naming the first one's pid and the
remedy; the lock file is opened without following a symlink (one planted there is refused, its target untouched);
only a plain lock file counts as the lock."""

from __future__ import annotations

import os

import pytest

from runtime.errors import JobError
from runtime.locks import exclusive, is_lock_file
from schemas import format as fmt
from schemas.files import UnsafeDestination


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
