"""precompute-ref under torchrun (2 ranks, gloo on CPU) on skewed lengths: shards dealt by their tokens, every rank's
progress lines, the spread of the ranks' wall times in the summary, and the one-process cache whatever the dealing;
with --token-budget auto, so the ranks agree on one budget."""

from __future__ import annotations

import json
import random
import re
import sys

from conftest import TORCHRUN, WORDS, run_in_session, shard_hashes, write_jsonl
from precompute.job import shard_work
from runtime.distributed import balanced_assignment


def skewed_rows(shards: int, per_shard: int) -> list[dict]:
    """Shards at even positions hold long prompts, those at odd positions short ones (data sorted by source)."""
    rng = random.Random(71)
    rows = []
    for s in range(shards):
        for _ in range(per_shard):
            q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 40) if s % 2 == 0 else rng.randint(2, 4)))
            rows.append({"id": f"r{len(rows):04d}", "prompt": q + "?", "chosen": "sure " + rng.choice(WORDS),
                         "rejected": "hmm " + rng.choice(WORDS)})
    return rows


def test_two_ranks_deal_shards_by_tokens_and_give_the_one_process_cache(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "prefs.jsonl", skewed_rows(6, 3))
    args = ["-m", "precompute.cli", "--model", str(llama_dir), "--data", str(data), "--rows-per-shard", "3",
            "--no-progress", "--token-budget", "auto"]
    one = run_in_session([sys.executable, *args, "--out", str(tmp_path / "one")], tmp_path)
    two = run_in_session([*TORCHRUN, *args, "--out", str(tmp_path / "two")], tmp_path)
    assert shard_hashes(tmp_path / "two") == shard_hashes(tmp_path / "one")  # bitwise, whoever scored a shard
    manifests = [json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("one", "two")]
    assert manifests[0]["shards"] == manifests[1]["shards"]
    assert manifests[1]["computation"]["token_budget_resolved"]["tokens"] == 16384
    # the dealing the log shows: by tokens (round-robin would put all three long shards on rank 0, ~7x the other's)
    per_rank = [int(t.replace(",", "")) for t in re.search(r"tokens per rank: ([\d,]+), ([\d,]+)", two.stderr).groups()]
    assert max(per_rank) / min(per_rank) < 1.5, per_rank
    for rank in (0, 1):
        lines = re.findall(rf"rank {rank}/2: shard (\d+)/(\d+) \(shard-\d+\.parquet\) done, [\d.,]+ pairs/s", two.stderr)
        assert lines and lines[-1][0] == lines[-1][1], two.stderr  # one line per shard, up to its last
    assert "ranks:" not in one.stdout and "rank 0/1" not in one.stderr  # one process: its bar, no rank lines
    assert re.search(r"ranks: 2, scoring wall per rank [\d.]+-[\d.]+ s \(spread [\d.]+ s, \d+% of the slowest\)",
                     two.stdout), two.stdout


def test_the_dealing_balances_these_shards():
    """What the torchrun test above runs: the same rows' shards, dealt by tokens and round-robin."""
    class Pair:
        def __init__(self, p, c, r):
            self.prompt_ids, self.chosen_ids, self.rejected_ids = [0] * p, [0] * c, [0] * r

    class Encoded:
        pairs = [Pair(35 if s % 2 == 0 else 3, 2, 2) for s in range(6) for _ in range(3)]

    shards = [{"start": 3 * s, "stop": 3 * s + 3} for s in range(6)]
    work = shard_work(Encoded, shards)
    assert work == [3 * (2 * 35 + 4), 3 * (2 * 3 + 4)] * 3
    dealt = balanced_assignment(work, 2)
    by_tokens = [sum(work[i] for i in r) for r in dealt]
    round_robin = [sum(work[0::2]), sum(work[1::2])]
    assert max(by_tokens) < max(round_robin) and max(by_tokens) - min(by_tokens) <= max(work)


def test_a_rank_dealt_no_shard_still_agrees_on_the_auto_budget(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "prefs.jsonl", skewed_rows(1, 3))  # one shard, two ranks
    out = tmp_path / "cache"
    two = run_in_session([*TORCHRUN, "-m", "precompute.cli", "--model", str(llama_dir), "--data", str(data), "--out",
                          str(out), "--rows-per-shard", "3", "--no-progress", "--token-budget", "auto"], tmp_path)
    assert re.search(r"tokens per rank: [\d,]+, 0\b", two.stderr), two.stderr
    assert "rank 0/2: shard 1/1" in two.stderr and "rank 1/2: shard" not in two.stderr
    assert "token budget: auto -> 16384" in two.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["computation"]["token_budget_resolved"]["tokens"] == 16384 and len(manifest["shards"]) == 1
