"""The batching-mode probe's own values of the job's longest pair are the cache's: the mode scored that pair in the
probe and was proven on it against the truth, so the job does not run it through the model a second time (issue 39:
the short job's fixed costs). Only the very pairs the probe scored whole, in the mode chosen, with the same top-k."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch

from precompute.job import PrecomputeConfig, run_precompute
from support import encoded_job
from precompute.modes import choose


def plain_logps(model, prompt, completion) -> np.ndarray:
    """Independent reference: one unpadded forward, log_softmax at each completion token."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = model(ids).logits.float().log_softmax(-1)[0]
    return np.array([logp[t - 1, ids[0, t]].item() for t in range(len(prompt), ids.shape[1])])


def _size(p) -> int:
    return len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids)


@pytest.fixture(scope="module")
def job(llama_dir, tmp_path_factory):
    return encoded_job(llama_dir, tmp_path_factory, "reuse", 12, seed=5)


def _counting(monkeypatch):
    """The pairs each score_pairs call (probe or job) runs through the model."""
    seen = []
    real = choose.score_pairs

    def counted(model, pairs, *args, **kwargs):
        seen.append(list(pairs))
        return real(model, pairs, *args, **kwargs)

    monkeypatch.setattr(choose, "score_pairs", counted)
    return seen


@pytest.mark.parametrize("mode", ["kv_cache", "full_forward", "packed"])
def test_the_longest_pair_is_scored_once_by_the_probe(job, mode, monkeypatch):
    model, pairs, pad, _ = job
    longest = max(pairs, key=_size)
    probed = {}
    chosen_mode = choose.choose_mode(model, mode, pairs[:4], _size(longest), pad, 4096, lambda m: None,
                                     long_pairs=[longest], probed=probed)
    assert chosen_mode == mode and probed["scores"]["mode"] == mode
    seen = _counting(monkeypatch)
    ticks = []
    chosen, rejected, stats = choose.score_known(model, pairs, pad, 4096, mode,
                                                 lambda n, t, reused=False: ticks.append((n, t, reused)),
                                                 known=probed["scores"])
    scored = [p for call in seen for p in call]
    whole = [p for p in probed["pairs"] if any(p is q for q in pairs)]  # the sample's longest and the job's
    assert any(p is longest for p in whole) and len(whole) == 2
    assert len(scored) == len(pairs) - len(whole) and not any(p is q for p in scored for q in whole)
    i = pairs.index(longest)
    _, probe_c, probe_r = probed["scores"]["pairs"][id(longest)]
    assert chosen[i] is probe_c and rejected[i] is probe_r
    for p, c, r in zip(pairs, chosen, rejected):  # every pair the plain forward's, the reused one included
        np.testing.assert_allclose(np.asarray(c.logps), plain_logps(model, p.prompt_ids, p.chosen_ids), atol=2e-5)
        np.testing.assert_allclose(np.asarray(r.logps), plain_logps(model, p.prompt_ids, p.rejected_ids), atol=2e-5)
    assert stats["tokens"] == sum(2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
    assert sum(n for n, _, _ in ticks) == len(pairs) and sum(t for _, t, _ in ticks) == stats["tokens"]
    # the batches that ran, then the probe's pairs once, marked (--torch-compile auto counts batches that ran)
    assert [r for _, _, r in ticks] == [False] * (len(ticks) - 1) + [True] and ticks[-1][0] == len(whole)
    assert choose.to_score(pairs, probed["scores"], mode, 0) == [p for p in pairs if not any(p is q for q in whole)]


def test_values_of_another_mode_a_cut_copy_or_another_top_k_are_scored_again(job, monkeypatch):
    model, pairs, pad, _ = job
    longest = max(pairs, key=_size)
    probed = {}
    choose.choose_mode(model, "kv_cache", pairs[:4], _size(longest), pad, 4096, lambda m: None,
                       long_pairs=[longest], probed=probed)
    known = probed["scores"]
    cut = [p for p in probed["pairs"] if all(p is not q for q in pairs)]
    assert cut  # the probe's short pairs are cut copies: never a job pair's values
    seen = _counting(monkeypatch)
    choose.score_known(model, pairs, pad, 4096, "full_forward", known=known)
    choose.score_known(model, pairs, pad, 4096, "kv_cache", top_k=3, known=known)
    copy = type(longest)(list(longest.prompt_ids), list(longest.chosen_ids), list(longest.rejected_ids))
    choose.score_known(model, [copy], pad, 4096, "kv_cache", known=known)
    assert [len(c) for c in seen] == [len(pairs), len(pairs), 1]


def test_the_job_stores_the_probes_values_of_its_longest_pair(job, llama_dir, tmp_path, monkeypatch):
    """End to end: the scoring ran every pair but the longest (the probe's), and every row of the cache, the
    longest's included, is the plain forward's."""
    model, _, _, data = job
    seen = _counting(monkeypatch)
    out = tmp_path / "cache"
    run_precompute(PrecomputeConfig(model=str(llama_dir), data=str(data), out=str(out), batching="kv_cache",
                                    progress=False), log=lambda m: None)
    rows = list(pl.read_parquet(out / "shard-00000.parquet").iter_rows(named=True))
    sizes = [len(r["prompt_input_ids"]) + len(r["chosen_input_ids"]) + len(r["rejected_input_ids"]) for r in rows]
    job_calls = [c for c in seen if len(c) > 4]  # the probe's batches are its few pairs
    assert len(job_calls) == 1 and len(rows) - 2 <= len(job_calls[0]) < len(rows)  # the probe's whole pairs: 1 or 2
    assert max(map(_size, job_calls[0])) < max(sizes)  # the longest was not scored again
    for r in rows:
        for side in ("chosen", "rejected"):
            want = plain_logps(model, r["prompt_input_ids"], r[f"{side}_input_ids"])
            np.testing.assert_allclose(r[f"{side}_logps"], want, atol=2e-5)


def test_an_update_whose_new_rows_the_probe_scored_whole_runs_no_batch(llama_dir, tmp_path):
    """An --update of one new row: the probe scores it whole (the job's longest and its first shard's), so its shard
    runs no batch; --torch-compile auto's calibration plans the batches of no pairs (found by the closing test run:
    packing's plan of no pairs failed) and the row is the cache's."""
    from support import precompute_cli, pref_rows, write_jsonl

    rows = pref_rows(9, seed=11)
    out = tmp_path / "cache"
    for data, extra in ((rows[:8], ()), (rows, ("--update",))):
        made = precompute_cli("--model", llama_dir, "--data", write_jsonl(tmp_path / "d.jsonl", data), "--out", out,
                              "--batching", "packed", *extra)
        assert made.exit_code == 0, made.output
    assert "1 row added" in made.output and "(1 scored now)" in made.output
