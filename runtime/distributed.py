"""This process's place in a torchrun job: rank 0 decides, every rank learns the result or the refusal. With tensor
parallelism (`tp_size` > 1) the ranks form groups of `tp_size` consecutive ranks, each group one copy of the model
split across its ranks: the group is the unit of data parallelism, its first rank the one that writes."""

from __future__ import annotations

import contextlib
import datetime
import os

from .errors import JobError


@contextlib.contextmanager
def _with_the_others(rank: int, what: str):
    """A collective call: a rank that waits on one that died (kill -9, out of memory, a lost node) gets the backend's
    connection error; say what it means instead of an unexpected RuntimeError."""
    try:
        yield
    except RuntimeError as e:  # torch.distributed's DistBackendError and the gloo/NCCL transport errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise JobError(f"rank {rank}: another rank of this job stopped while this one waited for it at {what} "
                       f"({first}); the log of that rank's node (its torchrun) names it and why. Nothing "
                       "incomplete was kept: run the same command again to go on from the completed work") from e


class Dist:
    """This process's place in a torchrun job (world 1 without torchrun), and in its tensor-parallel group (a group
    of one rank without tensor parallelism). `tp_size` must divide `world` (runtime.placement refuses it first)."""

    def __init__(self, rank: int | None = None, world: int | None = None, tp_size: int = 1):
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.world = int(os.environ.get("WORLD_SIZE", 1)) if world is None else world
        self.tp_size = tp_size

    @property
    def groups(self) -> int:
        """Copies of the model: the data-parallel width (the world without tensor parallelism)."""
        return max(1, self.world // self.tp_size)

    @property
    def group(self) -> int:
        """This rank's group: ranks group * tp_size ... group * tp_size + tp_size - 1 (the rank itself without TP)."""
        return self.rank // self.tp_size

    @property
    def leads(self) -> bool:
        """Whether this rank writes its group's results: the group's first rank (every rank without TP)."""
        return self.rank % self.tp_size == 0

    def name(self) -> str:
        """This rank, or under tensor parallelism its group, as a log line names it."""
        if self.tp_size == 1:
            return f"rank {self.rank}/{self.world}"
        first = self.group * self.tp_size
        return f"group {self.group}/{self.groups} (ranks {first}-{first + self.tp_size - 1})"

    @classmethod
    def joined(cls) -> "Dist":
        """The process group this process already belongs to (one the Trainer started); world 1 when there is none."""
        import torch.distributed as td

        return cls(td.get_rank(), td.get_world_size()) if td.is_available() and td.is_initialized() else cls(0, 1)

    def share(self, make, *, every_rank: bool = False, what: str = ""):
        """Rank 0 decides, every rank refuses: run `make` and end every rank the same way, with a result or a refusal.

        By default `make` runs on rank 0 only and every rank gets its result, or its exception re-raised as a
        JobError. With `every_rank`, each rank runs `make` and keeps its own result; a rank that fails raises its own
        exception and every other rank a JobError naming the first rank that failed ("rank N refused `what`: ...")."""
        outcome = None
        if every_rank or self.rank == 0:
            try:
                outcome = ("ok", make())
            except Exception as e:  # every rank must learn of the failure, or the others would wait forever
                outcome = ("error", e if every_rank or isinstance(e, JobError) else JobError(f"rank 0: {e}"))
        if self.world > 1:
            import torch.distributed  # only under torchrun: a single process needs no torch here
        if self.world > 1 and every_rank:
            failures = [None] * self.world
            mine = None if outcome[0] == "ok" else f"{type(outcome[1]).__name__}: {outcome[1]}"
            with _with_the_others(self.rank, what or "a shared decision"):
                torch.distributed.all_gather_object(failures, mine)
            failed = [(r, m) for r, m in enumerate(failures) if m is not None]
            if failed and outcome[0] == "ok":
                raise JobError(f"rank {failed[0][0]} refused{' ' + what if what else ''}: {failed[0][1]}")
        elif self.world > 1:
            box = [outcome]
            with _with_the_others(self.rank, what or "a shared decision"):
                torch.distributed.broadcast_object_list(box, src=0)
            outcome = box[0]
        if outcome[0] == "error":
            raise outcome[1]
        return outcome[1]

    def gather(self, value) -> list:
        """Every rank's `value`, by rank, on every rank (also a barrier); [value] in one process."""
        if self.world == 1:
            return [value]
        import torch.distributed

        box = [None] * self.world
        with _with_the_others(self.rank, "a gather of every rank's results"):
            torch.distributed.all_gather_object(box, value)
        return box

    def barrier(self):
        if self.world > 1:
            import torch.distributed

            with _with_the_others(self.rank, "a barrier"):
                torch.distributed.barrier()


@contextlib.contextmanager
def distributed(tp_size: int = 1):
    """Join the torchrun process group for the job's duration: gloo, over which only small objects cross; with
    tensor parallelism on CUDA also NCCL for the split model's tensors (objects still go over gloo)."""
    import torch
    import torch.distributed

    dist = Dist(tp_size=tp_size)
    started = dist.world > 1 and not torch.distributed.is_initialized()
    if started:
        backend = "cpu:gloo,cuda:nccl" if tp_size > 1 and torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(hours=12))
    try:
        yield dist
    finally:
        if started:
            torch.distributed.destroy_process_group()


def balanced_assignment(work: list[float], world: int) -> list[list[int]]:
    """Items (indices into `work`, e.g. shards by their tokens) dealt to `world` ranks so that ranks finish together:
    longest-processing-time first, each item in turn (most work first, ties by index) to the rank with the least
    work so far (ties: the lowest rank). Deterministic, so every rank computes the same assignment; each item goes to
    exactly one rank, each rank's items in index order; a rank may get none (fewer items than ranks)."""
    load, ranks = [0.0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += work[i]
    return [sorted(r) for r in ranks]
