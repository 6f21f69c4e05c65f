"""A full disk (or quota) while saving, told as one message naming the file, the device and the space left, whatever
library wrote (the refusal that carries it: runtime/disk.py). Recognised by the errno (Python's OSError: ENOSPC,
EDQUOT; libraries that drop it write it in their message: safetensors' "os error 28", pyarrow's "[errno 28]") or,
where the error carries none (torch.save's zip writer: "[enforce fail ...] PytorchStreamWriter failed writing file
...", "unexpected pos ..."), by the free space left on the device being written: never by a library's wording of a
failed write."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# the errno as libraries that do not raise OSError write it (and object stores' codes for the same condition)
NO_SPACE_TEXT = re.compile(r"no space left on device|disk quota exceeded|os error (?:28|122)\b|\[errno (?:28|122)\]|"
                           r"StorageFull|QuotaExceeded", re.IGNORECASE)
# A failed write without an errno is taken for a full device when less than this is free there: a write that ran out
# of space has filled the device (its partial file holds the rest). 64 MiB or 1% of the device, at most 1 GiB.
MARGIN_BYTES, MARGIN_SHARE, MARGIN_CAP = 64 * 2**20, 0.01, 2**30
# errors that say the program is wrong, not the device: never read as a full disk whatever the space left
PROGRAM_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError, NameError, AssertionError,
                  NotImplementedError, ZeroDivisionError, ImportError, RecursionError, MemoryError)


def is_no_space(exc: BaseException, target=None) -> bool:
    """`exc`, or an exception it was raised from, is a write that found no space: its errno says so, or (`target`:
    the file or folder being written, on a local device) it is a write error without an errno (an OSError, a
    RuntimeError such as torch's zip writer raises, a library's own error) and that device has less than the margin
    free (`nearly_full`)."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for e in chain:
        if isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS:
            return True
        if NO_SPACE_TEXT.search(str(e)):
            return True
    if target is None or any(isinstance(e, OSError) and e.errno is not None for e in chain):
        return False  # an errno that is not ENOSPC/EDQUOT names another cause
    if all(isinstance(e, PROGRAM_ERRORS) for e in chain):
        return False
    return nearly_full(target)


def nearly_full(target) -> bool:
    """The local device holding `target` (its nearest existing folder) has less than the margin free; False for a
    store URL or a place that cannot be read."""
    text = str(target)
    if "://" in text and not text.startswith("file://"):
        return False
    try:
        usage = shutil.disk_usage(_existing(Path(os.path.abspath(text.removeprefix("file://")))))
    except (OSError, ValueError):
        return False
    return usage.free < min(max(MARGIN_BYTES, MARGIN_SHARE * usage.total), MARGIN_CAP)


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


def no_space_message(exc: BaseException, target=None, consequence: str = "") -> str:
    """What to say of a save into `target` (a file or a folder; None: only what the error names) that found no
    space; `consequence`: what the failed save leaves behind."""
    file = _file_being_written(exc, Path(target)) if target is not None else _file_being_written(exc, Path("."))
    named = target is not None or file != Path(".")
    where = f"while writing {file}" if named else "while writing (the error names no file)"
    detail = " ".join(str(exc).split())[:200]
    return (f"no space left on device {device_of(file if named else '.')} {where}"
            f"{': ' + consequence if consequence else ''}; free space on that device or write to another "
            f"one\n  ({type(exc).__name__}: {detail})")

