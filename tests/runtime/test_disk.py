"""runtime/disk.py: a full device (or quota) during a save, from any library, is one refusal naming the file, the
device and the space left (issue 22 item 15); other errors pass unchanged."""

from __future__ import annotations

import errno
import os

import pytest

from runtime.disk import NoSpaceError, is_no_space, writing
from runtime.errors import JobError

ENFORCE_FAIL = ("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0: file "
                "write failed")


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EDQUOT, "Disk quota exceeded"),
    RuntimeError(ENFORCE_FAIL),  # torch.save: no errno at all
    Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on '
              'device" })'),  # safetensors
    OSError("[Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device"),  # pyarrow
], ids=["ENOSPC", "EDQUOT", "torch", "safetensors", "pyarrow"])
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
        raise RuntimeError(ENFORCE_FAIL)
    message = str(raised.value)
    assert isinstance(raised.value, JobError)
    assert message.startswith("no space left on device ") and f"while writing {half}: checkpoint-4 is incomplete" \
        in message and "mounted at" in message and "MiB free" in message
    named = tmp_path / "metrics.jsonl"
    with pytest.raises(NoSpaceError, match=rf"while writing {named}"), writing(folder):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(named))  # the error's own file name wins
