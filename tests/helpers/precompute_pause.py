"""precompute-ref that stops in the middle of writing one shard, for the kill -9 test.

Usage: python tests/helpers/precompute_pause.py PRECOMPUTE-REF-ARGS...
with REFCACHE_PAUSE_AT_SHARD=k (0-based count of shard files written) and REFCACHE_PAUSE_MARKER=path in the
environment. Shard k's Parquet bytes go into its temp file, then the marker file is created and the process sleeps
until it is killed; nothing else about the run changes. Under torchrun, REFCACHE_PAUSE_RANK=r pauses only the process
of global rank r (the others run on as usual).
"""

import os
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

PAUSE_AT = int(os.environ["REFCACHE_PAUSE_AT_SHARD"])
PAUSES = os.environ.get("REFCACHE_PAUSE_RANK", os.environ.get("RANK", "0")) == os.environ.get("RANK", "0")
MARKER = Path(os.environ["REFCACHE_PAUSE_MARKER"])
_write_table = pq.write_table
_written = 0


def write_table(table, where, *args, **kwargs):
    global _written
    _write_table(table, where, *args, **kwargs)
    if PAUSES and _written == PAUSE_AT:
        where.flush()
        MARKER.write_text(str(os.getpid()))
        time.sleep(600)
        sys.exit("precompute_pause: not killed within 600 s")
    _written += 1


pq.write_table = write_table  # schemas.format calls pq.write_table through the module

from precompute.cli import main  # noqa: E402  (after the patch above)

if __name__ == "__main__":
    main()
