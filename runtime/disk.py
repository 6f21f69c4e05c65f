"""A full disk (or quota) while saving, as a command's refusal: one paragraph naming the file, the device and the
space left, whatever library wrote (how a full device is recognised and described: storage/disk.py)."""

from __future__ import annotations

from contextlib import contextmanager

from storage.disk import is_no_space, no_space_message

from .errors import JobError


class NoSpaceError(JobError):
    """A save that failed because the device is full (or the quota is used up)."""


def no_space_error(exc: BaseException, target=None, consequence: str = "") -> NoSpaceError:
    """The refusal for a save into `target` (a file or a folder; None: only what the error names) that found no
    space; `consequence`: what the failed save leaves behind."""
    return NoSpaceError(no_space_message(exc, target, consequence))


@contextmanager
def writing(target, consequence: str = ""):
    """Around a save into `target`: a full device becomes a NoSpaceError naming the file and the device; any other
    error passes unchanged."""
    try:
        yield
    except NoSpaceError:
        raise
    except Exception as e:
        if is_no_space(e, target):
            raise no_space_error(e, target, consequence) from e
        raise
