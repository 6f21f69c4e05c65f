"""Run under torchrun (gloo): every case of runtime.distributed.Dist.share on each rank, written as one JSON file per
rank (OUT_DIR/share-rank<N>.json; not stdout, where the ranks' lines can interleave) for
tests/runtime/test_distributed.py.

    torchrun --nproc-per-node 2 share_ranks.py OUT_DIR
"""

import json
import sys
from pathlib import Path

from runtime.distributed import distributed
from runtime.errors import JobError


def outcome(fn):
    try:
        return {"result": fn()}
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e)}


def main():
    with distributed() as dist:
        ran = []

        def make(value=None, fail_on=None, error=ValueError):
            def run():
                ran.append(dist.rank)
                if dist.rank == fail_on:
                    raise error(f"bad on rank {dist.rank}")
                return value if value is not None else dist.rank
            return run

        cases = {
            "rank0_ok": outcome(lambda: dist.share(make())),
            "rank0_ran": list(ran),
            "rank0_fails": outcome(lambda: dist.share(make(fail_on=0))),
            "rank0_refuses": outcome(lambda: dist.share(make(fail_on=0, error=JobError))),
            "each_ok": outcome(lambda: dist.share(make(), every_rank=True)),
            "each_rank1_fails": outcome(lambda: dist.share(make(fail_on=1), every_rank=True, what="the cache")),
        }
        result = json.dumps({"rank": dist.rank, "world": dist.world, **cases})
        (Path(sys.argv[1]) / f"share-rank{dist.rank}.json").write_text(result)


if __name__ == "__main__":
    main()
