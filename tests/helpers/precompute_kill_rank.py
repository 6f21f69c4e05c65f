"""precompute-ref whose rank KILL_RANK SIGKILLs itself right after writing its KILL_AFTER-th shard (for torchrun
fault tests). Everything else is the real command."""

import os
import signal

from precompute import job
from precompute.cli import main
from schemas import format as fmt

KILL_RANK = int(os.environ.get("KILL_RANK", 1))
KILL_AFTER = int(os.environ.get("KILL_AFTER", 1))
_write_shard = fmt.write_shard
_written = 0


def write_shard_then_die(*args, **kwargs):
    global _written
    entry = _write_shard(*args, **kwargs)
    _written += 1
    if int(os.environ.get("RANK", 0)) == KILL_RANK and _written >= KILL_AFTER:
        os.kill(os.getpid(), signal.SIGKILL)
    return entry


job.fmt.write_shard = write_shard_then_die

if __name__ == "__main__":
    main()
