"""The rows of a job cut into shards, in input order: what precompute-ref scores and writes (and --update, over the
rows it scores)."""

from __future__ import annotations

from runtime.data import Encoded
from schemas.encoding import EncodingConfig
from schemas.stamps import combined_mask_checksum, ids_checksum


def plan_shards(encoded: Encoded, rows_per_shard: int, encoding: EncodingConfig) -> list[dict]:
    checks = [p.mask_checksum for p in encoded.pairs]
    plan = []
    for n, start in enumerate(range(0, len(checks), rows_per_shard)):
        stop = min(start + rows_per_shard, len(checks))
        plan.append({"file": f"shard-{n:05d}.parquet", "start": start, "stop": stop,
                     "mask_checksum": combined_mask_checksum(checks[start:stop], encoding.to_json()),
                     "ids_checksum": ids_checksum(encoded.ids[start:stop])})
    return plan
