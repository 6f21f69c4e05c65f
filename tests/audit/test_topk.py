"""audit-ref on a top-k cache (issue 24, item 3): a cache given the six top-k columns of the contract, computed with
`runtime.logprobs.reference_top_k` from the shipped data/ model on rows of words it was not trained on (as
precompute-ref --top-k K writes them), passes every check; each property damaged on its own fails exactly the check
that owns it, at the row damaged; the replay (--model) finds what the cache's own rules cannot; a cache without top-k
columns skips the top-k checks and nothing else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import DATA, audit_ref as audit, check_of as check, float32_sum, statuses
from conftest import precompute_in_process as precompute, pref_rows, rewrite_top_k_shard, write_jsonl
from audit.checks import SECTIONS
from schemas import format as fmt
from schemas import rules
from schemas.stamps import canonical_json
from storage.reads import file_sha256

K = 8
MODEL = DATA / "sft-model"
TOP_K_CHECKS = (*rules.TOP_K_RULES, "replay_top_k")
TYPES = {"top_ids": pa.list_(pa.list_(pa.int32())), "top_logps": pa.list_(pa.list_(pa.float32())),
         "tail": pa.list_(pa.float32())}
SHARD = "shard-00001.parquet"


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("audit-top-k")
    # words the model was not trained on: their tokens are among its top-k at some positions, not at others
    data = write_jsonl(base / "prefs.jsonl", pref_rows(12))
    plain = precompute(MODEL, data, base / "plain", rows_per_shard=4)
    top_k = precompute(MODEL, data, base / "top-k", rows_per_shard=4, top_k=K)
    whole = precompute(MODEL, data, base / "whole", rows_per_shard=4, top_k=1024)  # K = vocabulary: tail -inf
    return {"plain": plain, "top_k": top_k, "whole": whole}


@pytest.fixture()
def cache(caches, tmp_path) -> Path:
    return Path(shutil.copytree(caches["top_k"], tmp_path / "cache"))


def rows_of(cache: Path, name: str = SHARD) -> list[dict]:
    return fmt.read_columns(cache / name).to_pylist()


def position(rows, where) -> tuple[int, str, int]:
    """(row, side, token) of the first completion token for which `where(token id, its top ids, its tail)` holds."""
    for i, r in enumerate(rows):
        for side in ("chosen", "rejected"):
            for j, at in enumerate(zip(r[f"{side}_input_ids"], r[f"{side}_top_ids"], r[f"{side}_tail"])):
                if where(*at):
                    return i, side, j
    raise AssertionError("no such token in the shard")


present = lambda token, ids, tail: token in ids
absent = lambda token, ids, tail: token not in ids


# ---------------------------------------------------------------------------------------------------------------
# clean caches


def test_a_clean_top_k_cache_passes_every_check(caches):
    code, report, output = audit(caches["top_k"], "--model", MODEL, "--all")
    assert code == 0, output
    assert statuses(report) == {n: "SKIP" if n in SECTIONS["data"] + SECTIONS["run"] else "PASS"
                                for names in SECTIONS.values() for n in names}
    assert check(report, "top_k_ids")["detail"].startswith("12 rows: ")
    info = check(report, "replay_top_k")["info"]
    assert (info["rows"], info["k"], info["tokens_beyond_tolerance"]) == (12, K, 0)
    # the replay's figures against values as read: 16-bit codes, within fmt.LOGP_ERROR of what was scored, then
    # normalised (every value of a position shifted by the same |log Z| <= LOGP_ERROR; FORMAT.md)
    assert info["tokens"] == check(report, "replay")["info"]["tokens"]
    assert info["token_max_abs_diff"] <= 2 * fmt.LOGP_ERROR + 1e-5
    # replayed in padded batches (top-k from the same forward), trusted after matching reference_top_k on a probe
    layout = check(report, "replay")["info"]
    assert layout["fallback"] is None and "matching reference_logps on 4 probe rows" in layout["layout"]


def test_top_k_as_large_as_the_vocabulary_has_an_empty_tail_and_passes(caches):
    rows = rows_of(caches["whole"])
    assert all(t == float("-inf") for r in rows for t in r["chosen_tail"])
    code, report, output = audit(caches["whole"], "--model", MODEL, "--sample", 3)
    assert code == 0, output
    assert all(statuses(report)[n] == "PASS" for n in TOP_K_CHECKS)


def test_a_cache_without_top_k_skips_the_top_k_checks_only(caches):
    code, report, output = audit(caches["plain"], "--model", MODEL, "--sample", 3)
    assert code == 0, output
    for name in TOP_K_CHECKS:
        assert check(report, name)["status"] == "SKIP"
        assert check(report, name)["detail"].startswith("no top-k columns"), name
    assert all(s == "PASS" for n, s in statuses(report).items() if n not in TOP_K_CHECKS + SECTIONS["data"]
               + SECTIONS["run"])


# ---------------------------------------------------------------------------------------------------------------
# each property damaged on its own


def id_out_of_range(rows):
    rows[3]["chosen_top_ids"][1][2] = 1024  # the vocabulary is 0..1023
    return 3, "top_k_ids", "id 1024 outside 0..1023"


def duplicate_id(rows):
    ids = rows[1]["rejected_top_ids"][0]
    ids[3] = ids[2]
    return 1, "top_k_ids", f"id {ids[2]} twice"


def unsorted(rows):
    ids, logps = rows[2]["chosen_top_ids"][2], rows[2]["chosen_top_logps"][2]
    assert logps[0] > logps[1]
    ids[0], ids[1], logps[0], logps[1] = ids[1], ids[0], logps[1], logps[0]  # each id keeps its log-prob
    return 2, "top_k_order", "chosen token 2: top_logps"


def mass_and_tail_not_one(rows):
    i, side, j = position(rows, lambda token, ids, tail: np.exp(tail) > 0.05)
    rows[i][f"{side}_tail"][j] -= 1.0
    return i, "top_k_mass", f"{side} token {j}: the top-k mass plus the tail's is 0."


def dataset_logp_differs_from_its_entry(rows):
    i, side, j = position(rows, present)
    rows[i][f"{side}_logps"][j] -= 0.01 + 2 * float(rules.top_k_allowance(rows[i][f"{side}_logps"][j]))
    rows[i][f"{side}_logp"] = float32_sum(rows[i][f"{side}_logps"])
    return i, "top_k_dataset", f"{side} token {j} (id {rows[i][f'{side}_input_ids'][j]}): its log-prob"


def dataset_logp_above_the_kth(rows):
    i, side, j = position(rows, absent)
    kth = rows[i][f"{side}_top_logps"][j][-1]
    rows[i][f"{side}_logps"][j] = kth + 0.01 + 2 * float(rules.top_k_allowance(kth))
    rows[i][f"{side}_logp"] = float32_sum(rows[i][f"{side}_logps"])
    return i, "top_k_dataset", f"{side} token {j} (id {rows[i][f'{side}_input_ids'][j]}): not among the top-k"


# A log-prob above 0 and a token without K entries cannot be stored (the codes clamp at 0; the writer and
# read_columns refuse a torn column): tests/schemas/test_rules.py judges those on a table (TOP_K_TABLE_CASES).
DAMAGES = [id_out_of_range, duplicate_id, unsorted, mass_and_tail_not_one, dataset_logp_differs_from_its_entry,
           dataset_logp_above_the_kth]


@pytest.mark.parametrize("damage", DAMAGES, ids=[d.__name__ for d in DAMAGES])
def test_each_damage_fails_exactly_its_check(cache, damage):
    said = {}
    rewrite_top_k_shard(cache, SHARD, lambda rows: said.update(zip(("row", "check", "text"), damage(rows))))
    code, report, output = audit(cache)
    assert code == 1, output
    assert report["failed"] == [said["check"]], output
    failed = check(report, said["check"])
    assert (failed["shard"], failed["row"]) == (SHARD, said["row"])
    assert failed["detail"].startswith("1 of 12 rows: top-k columns of row ") and said["text"] in failed["detail"]


# ---------------------------------------------------------------------------------------------------------------
# the replay (--model): what the cache's own rules cannot see


def lower_a_value(rows):
    """A log-prob at the last rank lowered by twice what the replay allows it (1e-4 + its storage's rounding): still
    sorted, the mass within its tolerance, the dataset token elsewhere."""
    i, side, j = position(rows, absent)
    v = rows[i][f"{side}_top_logps"][j][-1]
    rows[i][f"{side}_top_logps"][j][-1] -= 2 * (1e-4 + float(rules.top_k_allowance(v)))
    return i, f"{side} token {j} rank {K - 1}"


def swap_an_id(rows):
    """The last id replaced by one outside the top-k (neither the dataset token nor a tie)."""
    i, side, j = position(rows, absent)
    ids = rows[i][f"{side}_top_ids"][j]
    ids[-1] = next(t for t in range(1024) if t not in ids and t != rows[i][f"{side}_input_ids"][j])
    return i, f"{side} token {j} rank {K - 1}: cached id {ids[-1]}"


def shift_the_tail(rows):
    """A tail between 0.1 % and 5 % made 1 % smaller: the mass moves by less than its tolerance, the tail by 1e-2,
    more than its allowance."""
    i, side, j = position(rows, lambda token, ids, tail: 1e-3 < np.exp(tail) < 0.05)
    rows[i][f"{side}_tail"][j] += float(np.log(0.99))
    return i, f"{side} token {j} tail"


@pytest.mark.parametrize("damage", [lower_a_value, swap_an_id, shift_the_tail])
def test_the_replay_finds_what_the_rules_cannot(cache, damage):
    said = {}
    rewrite_top_k_shard(cache, SHARD, lambda rows: said.update(zip(("row", "text"), damage(rows))))
    code, report, output = audit(cache, "--model", MODEL, "--all")
    assert code == 1, output
    assert report["failed"] == ["replay_top_k"], output
    failed = check(report, "replay_top_k")
    assert (failed["shard"], failed["row"]) == (SHARD, said["row"]) and said["text"] in failed["detail"]
    assert failed["info"]["tokens_beyond_tolerance"] == 1


def test_the_replay_takes_two_ids_of_the_same_log_prob_in_either_order(cache):
    """Two neighbouring ids whose log-probs differ by less than the tolerance swapped (neither the dataset token):
    a tie, not a difference."""
    def near_tie(rows) -> bool:
        for r in rows:
            for side in ("chosen", "rejected"):
                for token, ids, logps in zip(r[f"{side}_input_ids"], r[f"{side}_top_ids"], r[f"{side}_top_logps"]):
                    for n in range(K - 1):
                        if logps[n] - logps[n + 1] < 1e-3 and token not in ids[n:n + 2]:
                            ids[n], ids[n + 1] = ids[n + 1], ids[n]
                            return True
        return False

    shard = next((p.name for p in sorted(cache.glob("*.parquet")) if near_tie(rows_of(cache, p.name))), None)
    assert shard, "no near tie in the cache"
    rewrite_top_k_shard(cache, shard, near_tie)
    code, report, output = audit(cache, "--model", MODEL, "--all")
    assert code == 0, output
    assert check(report, "replay_top_k")["info"]["ids_tied"] == 2



def test_a_top_k_larger_than_the_vocabulary_is_refused_and_not_replayed(cache):
    """computation.top_k edited to 5000 in the manifest and in every footer (so the stamps agree): the columns no
    longer hold K values per token, so the reader refuses the shards (shard_files) and nothing is replayed."""
    manifest = json.loads((cache / fmt.MANIFEST).read_text())
    for entry in manifest["shards"]:
        path = cache / entry["file"]
        table = pq.read_table(path)
        meta = dict(table.schema.metadata)
        meta[b"refcache.computation"] = canonical_json({**json.loads(meta[b"refcache.computation"]), "top_k": 5000})
        pq.write_table(table.replace_schema_metadata(meta), path, compression="zstd")
        entry.update(bytes=path.stat().st_size, sha256=file_sha256(path))
    manifest["computation"]["top_k"] = 5000
    fmt.write_manifest(cache, manifest)
    code, report, output = audit(cache, "--model", MODEL, "--sample", 2)
    assert code == 1, output
    assert report["failed"] == ["shard_files"], output
    assert "5000" in check(report, "shard_files")["detail"] or "K values" in check(report, "shard_files")["detail"]
    assert check(report, "replay_top_k")["status"] == "SKIP"
