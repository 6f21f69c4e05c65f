"""Count the Parquet reads of train-dpo's verification (dpo.verify.verify_and_join) on a cache of data/prefs made
under data/sft-model (written to CACHE_DIR the first time):

    PYTHONPATH=. python tests/helpers/verify_reads.py CACHE_DIR

Issue 23 measured, for 7 shards: before the reader {read_schema: 14, ParquetFile: 7, read_table: 21} (each footer
read 3 times, the id column 3 times), after {ParquetFile: 7, read_table: 14} (each footer and column once)."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq


def main(out: Path) -> None:
    if not (out / "manifest.json").exists():
        from precompute.job import PrecomputeConfig, run_precompute

        run_precompute(PrecomputeConfig(model="data/sft-model", data="data/prefs/train.jsonl", out=str(out),
                                        rows_per_shard=64, progress=False), log=lambda m: None)
    counts = collections.Counter()

    def counting(name):
        original = getattr(pq, name)

        def call(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        setattr(pq, name, call)

    for name in ("read_table", "read_metadata", "read_schema", "ParquetFile"):
        counting(name)
    from transformers import AutoTokenizer

    from dpo.verify import verify_and_join

    tokenizer = AutoTokenizer.from_pretrained("data/sft-model")
    counts.clear()
    verified = verify_and_join(tokenizer=tokenizer, model_dir="data/sft-model", data="data/prefs/train.jsonl",
                               split="train", cache_dir=str(out), log=lambda m: None)
    shards = len(json.loads((out / "manifest.json").read_text())["shards"])
    print(f"shards {shards}, rows {verified.table.num_rows}: {dict(counts)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
