"""storage/files.py: every write of the product goes through these, and none of them follows a symlink, writes into a
hard-linked file or over something that is not a regular file; the file planted there (and what it points to) is left
exactly as it was."""

from __future__ import annotations

import os

import pytest

from storage.files import UnsafeDestination, append_text, atomic_write, open_nofollow, remove_file



def untouched(victim):
    assert victim.read_text() == "precious\n"


def test_atomic_write_replaces_a_plain_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text("old")
    atomic_write(path, lambda f: f.write(b"new"))
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


@pytest.mark.parametrize("write", ["atomic_write", "append_text", "remove_file"])
def test_a_symlink_at_the_destination_is_refused_not_followed_nor_replaced(tmp_path, victim, write):
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(victim)
    call = {"atomic_write": lambda: atomic_write(link, lambda f: f.write(b"x")),
            "append_text": lambda: append_text(link, "x\n"), "remove_file": lambda: remove_file(link)}[write]
    with pytest.raises(UnsafeDestination, match=rf"{link} is a symlink \(to {victim}\): refcache does not write "
                                                r"there"):
        call()
    untouched(victim)
    assert link.is_symlink() and os.readlink(link) == str(victim)  # not deleted either
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "metrics.jsonl"]  # no temporary left


def test_a_symlink_planted_at_the_temporary_name_is_refused(tmp_path, victim):
    path = tmp_path / "manifest.json"
    planted = tmp_path / f".manifest.json.tmp-{os.getpid()}"
    planted.symlink_to(victim)
    with pytest.raises(UnsafeDestination, match="is a symlink"):
        atomic_write(path, lambda f: f.write(b"x"))
    untouched(victim)
    assert planted.is_symlink() and not path.exists()


def test_a_hard_link_a_fifo_and_a_folder_are_refused_for_appending(tmp_path, victim):
    linked = tmp_path / "metrics.jsonl"
    os.link(victim, linked)
    with pytest.raises(UnsafeDestination, match=r"is a hard link \(the same file has 2 names\)"):
        append_text(linked, "x\n")
    untouched(victim)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UnsafeDestination, match="is not a regular file"):  # and did not block waiting for a reader
        open_nofollow(fifo, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    (tmp_path / "folder").mkdir()
    for call in (lambda: append_text(tmp_path / "folder", "x"), lambda: atomic_write(tmp_path / "folder", print)):
        with pytest.raises(UnsafeDestination, match="is a folder"):
            call()


def test_an_atomic_write_over_a_hard_link_leaves_the_other_name_as_it_was(tmp_path, victim):
    """Replacing by rename gives the destination name a new file; the other name keeps its content."""
    linked = tmp_path / "report.json"
    os.link(victim, linked)
    atomic_write(linked, lambda f: f.write(b"{}\n"))
    untouched(victim)
    assert linked.read_text() == "{}\n"


def test_remove_file_deletes_a_plain_file_and_ignores_a_missing_one(tmp_path):
    path = tmp_path / "skipped.jsonl"
    path.write_text("{}\n")
    remove_file(path)
    remove_file(path)
    assert not path.exists()
