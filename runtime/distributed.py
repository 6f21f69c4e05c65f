"""This process's place in a torchrun job: rank 0 decides, every rank learns the result or the refusal."""

from __future__ import annotations

import contextlib
import datetime
import os

import torch

from .errors import JobError


class Dist:
    """This process's place in a torchrun job (world 1 without torchrun)."""

    def __init__(self):
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))

    def share(self, make):
        """Run `make` on rank 0 and give every rank its result, or its exception re-raised as a JobError."""
        result = None
        if self.rank == 0:
            try:
                result = ("ok", make())
            except Exception as e:  # every rank must learn of the failure, or the others would wait forever
                result = ("error", e if isinstance(e, JobError) else JobError(f"rank 0: {e}"))
        if self.world > 1:
            box = [result]
            torch.distributed.broadcast_object_list(box, src=0)
            result = box[0]
        if result[0] == "error":
            raise result[1]
        return result[1]

    def barrier(self):
        if self.world > 1:
            torch.distributed.barrier()


@contextlib.contextmanager
def distributed():
    """Join the torchrun process group for the job's duration (gloo: only small objects cross it)."""
    dist = Dist()
    started = dist.world > 1 and not torch.distributed.is_initialized()
    if started:
        torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(hours=12))
    try:
        yield dist
    finally:
        if started:
            torch.distributed.destroy_process_group()
