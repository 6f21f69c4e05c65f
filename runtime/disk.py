"""A full disk (or quota) while saving, told as one refusal naming the file, the device and the space left, whatever
library wrote: Python's OSError (ENOSPC, EDQUOT), torch.save's "[enforce fail ...] PytorchStreamWriter failed writing
file", safetensors' and pyarrow's "No space left on device"."""

from __future__ import annotations

import errno
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from .errors import JobError

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Libraries that do not raise OSError say it in their message; torch's zip writer gives no errno at all (its failed
# fwrite on a full disk is the one message below).
NO_SPACE_TEXT = re.compile(r"no space left on device|disk quota exceeded|os error (?:28|122)\b|StorageFull|"
                           r"QuotaExceeded|PytorchStreamWriter failed writing file",
                           re.IGNORECASE)


class NoSpaceError(JobError):
    """A save that failed because the device is full (or the quota is used up)."""


def is_no_space(exc: BaseException) -> bool:
    """`exc`, or an exception it was raised from, is a write that found no space."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS:
            return True
        if NO_SPACE_TEXT.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def device_of(path) -> str:
    """'DEVICE mounted at MOUNT, N free' for the filesystem holding `path` (the device from /proc/self/mounts where
    there is one, else its major:minor number)."""
    where = _existing(Path(os.path.abspath(path)))
    mount = where
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    dev = os.stat(where).st_dev
    name = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 1 and fields[1] == str(mount):
                name = fields[0]  # the last entry for a mount point is the one in effect
    except OSError:
        pass
    free = shutil.disk_usage(where).free
    return f"{name} mounted at {mount}, {free / 2**20:.1f} MiB free"


def _file_being_written(exc: BaseException, target: Path) -> Path:
    """The file named by the error, else (torch names only the entry inside its zip) the newest file under `target`:
    the one being written when the device filled up."""
    for e in (exc, exc.__cause__, exc.__context__):
        if isinstance(e, OSError) and e.filename:
            return Path(e.filename)
    if target.is_dir() and not target.is_symlink():
        files = [p for p in target.rglob("*") if p.is_file() and not p.is_symlink()]
        if files:
            return max(files, key=lambda p: p.stat().st_mtime_ns)
    return target


def no_space_error(exc: BaseException, target=None, consequence: str = "") -> NoSpaceError:
    """The refusal for a save into `target` (a file or a folder; None: only what the error names) that found no
    space; `consequence`: what the failed save leaves behind."""
    file = _file_being_written(exc, Path(target)) if target is not None else _file_being_written(exc, Path("."))
    named = target is not None or file != Path(".")
    where = f"while writing {file}" if named else "while writing (the error names no file)"
    detail = " ".join(str(exc).split())[:200]
    return NoSpaceError(f"no space left on device {device_of(file if named else '.')} {where}"
                        f"{': ' + consequence if consequence else ''}; free space on that device or write to another "
                        f"one\n  ({type(exc).__name__}: {detail})")


@contextmanager
def writing(target, consequence: str = ""):
    """Around a save into `target`: a full device becomes a NoSpaceError naming the file and the device; any other
    error passes unchanged."""
    try:
        yield
    except NoSpaceError:
        raise
    except Exception as e:
        if is_no_space(e):
            raise no_space_error(e, target, consequence) from e
        raise
