"""runtime/disk.py: a full device (or quota) during a save, from any library, is one refusal naming the file, the
device and the space left (issue 22 item 15); other errors pass unchanged. An error without an errno (torch's zip
writer) is a full disk by the free space left where it wrote, never by its wording (issue 34 family 9)."""

from __future__ import annotations

import errno
import os
import shutil
from collections import namedtuple

import pytest

import storage.disk
from runtime.disk import NoSpaceError, writing
from storage.disk import is_no_space
from runtime.errors import JobError

ENFORCE_FAIL = ("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0: file "
                "write failed")
# the other wordings torch's writer gives a full disk, and one nobody has seen yet
TORCH_VARIANTS = [ENFORCE_FAIL, "[enforce fail at inline_container.cc:603] . unexpected pos 2560 vs 2458",
                  "PytorchStreamWriter failed writing central directory: file write failed",
                  "a new wording of a failed write"]
Usage = namedtuple("Usage", "total used free")


@pytest.fixture()
def device_free(monkeypatch):
    """Make the device of one folder report `free` bytes (of 100 GiB); every other path reports the real figures."""
    real = shutil.disk_usage

    def set_free(folder, free):
        def disk_usage(path):
            if os.path.abspath(path).startswith(os.path.abspath(folder)):
                return Usage(100 * 2**30, 100 * 2**30 - free, free)
            return real(path)

        monkeypatch.setattr(storage.disk.shutil, "disk_usage", disk_usage)

    return set_free


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EDQUOT, "Disk quota exceeded"),
    Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on '
              'device" })'),  # safetensors
    OSError("[Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device"),  # pyarrow
], ids=["ENOSPC", "EDQUOT", "safetensors", "pyarrow"])
def test_every_kind_of_full_device_is_recognised(error):
    assert is_no_space(error)
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = error
    assert is_no_space(wrapped)


@pytest.mark.parametrize("error", [OSError(errno.EACCES, "Permission denied"), RuntimeError("CUDA out of memory"),
                                   ValueError("bad value")])
def test_other_errors_pass_unchanged(error, tmp_path):
    assert not is_no_space(error)
    with pytest.raises(type(error)) as raised, writing(tmp_path):
        raise error
    assert raised.value is error


def test_the_refusal_names_the_file_being_written_and_the_device(tmp_path):
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x")
    half = folder / "optimizer.pt"
    half.write_bytes(b"PK half")
    os.utime(folder / "model.safetensors", (1, 1))  # older: optimizer.pt is the one being written
    with pytest.raises(NoSpaceError) as raised, writing(folder, "checkpoint-4 is incomplete"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # no file named: the newest file under the folder
    message = str(raised.value)
    assert isinstance(raised.value, JobError)
    assert message.startswith("no space left on device ") and f"while writing {half}: checkpoint-4 is incomplete" \
        in message and "mounted at" in message and "MiB free" in message
    named = tmp_path / "metrics.jsonl"
    with pytest.raises(NoSpaceError, match=rf"while writing {named}"), writing(folder):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(named))  # the error's own file name wins


@pytest.mark.parametrize("text", TORCH_VARIANTS)
def test_an_error_without_errno_on_a_full_device_is_a_full_disk(tmp_path, device_free, text):
    """torch.save's RuntimeError (no errno) during a save into a device with (almost) nothing free: the refusal,
    whatever its wording."""
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    (folder / "optimizer.pt").write_bytes(b"PK half")
    device_free(tmp_path, 4096)
    assert is_no_space(RuntimeError(text), folder)
    with pytest.raises(NoSpaceError) as raised, writing(folder, "checkpoint-2 is incomplete"):
        raise RuntimeError(text)
    message = str(raised.value)
    assert message.startswith("no space left on device ") and f"while writing {folder / 'optimizer.pt'}" in message
    assert "0.0 MiB free" in message and text in message  # the library's own words kept as the detail


@pytest.mark.parametrize("text", TORCH_VARIANTS)
def test_the_same_error_with_space_left_stays_a_crash(tmp_path, device_free, text):
    """The reverse: torch's own full-disk wording on a device with plenty free is not a full disk (the error passes
    unchanged, the command's crash path)."""
    device_free(tmp_path, 50 * 2**30)
    error = RuntimeError(text)
    assert not is_no_space(error, tmp_path)
    with pytest.raises(RuntimeError) as raised, writing(tmp_path):
        raise error
    assert raised.value is error


def test_the_margin_and_what_is_never_a_full_disk(tmp_path, device_free):
    """Just under the margin is full, just over is not; a programming error, an errno naming another cause and a
    store URL are never read as a full disk whatever the space."""
    device_free(tmp_path, storage.disk.MARGIN_CAP)  # 1% of 100 GiB is over the cap: the cap is the margin
    assert not is_no_space(RuntimeError(ENFORCE_FAIL), tmp_path)
    device_free(tmp_path, storage.disk.MARGIN_CAP - 1)
    assert is_no_space(RuntimeError(ENFORCE_FAIL), tmp_path)
    device_free(tmp_path, 0)
    assert is_no_space(Exception("a library's own write error"), tmp_path)
    for error in (TypeError("bad argument"), ValueError("bad value"), OSError(errno.EACCES, "Permission denied")):
        assert not is_no_space(error, tmp_path)
    assert not is_no_space(RuntimeError(ENFORCE_FAIL), "s3://bucket/prefix")
    assert not is_no_space(RuntimeError(ENFORCE_FAIL))  # no place known: only an errno says it
