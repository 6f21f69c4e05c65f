"""audit-ref --html / --show with --run (audit/policy.py, issue 36 "a single-row view fast"): a page of many rows
scores the policy in length-sorted padded batches under the cache's recorded token budget, once they reproduce the
definition on probe rows. Every log-ratio the page is rendered from (and a top-k cache's KL) is checked against the
policy's plain forward over the unpadded sequence computed here (log_softmax, gather), to 1e-5 in float32: every row,
the longest alone in its batch among batches of several; batches that disagree with the definition are not used; a
one-row view runs no batch and imports no datasets."""

from __future__ import annotations

import re

import numpy as np
import polars as pl
import pytest
import torch

from support import audit_streams as audit
from conftest import build_llama, fake_run, make_lora_adapter, manifest_of, precompute_in_process, save_checkpoint
from schemas import format as fmt

K = 4
TOL = 1e-5


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, tokenizer):
    return save_checkpoint(build_llama(len(tokenizer), seed=5), tokenizer, tmp_path_factory.mktemp("policy") / "p")


@pytest.fixture(scope="module")
def policy(policy_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()


def cached_rows(cache) -> dict[str, dict]:
    """Every row as the format reads it (top-k columns as [T, K]), by id."""
    rows = pl.concat([pl.from_arrow(fmt.read_columns(cache / s["file"]).replace_schema_metadata(None))
                      for s in manifest_of(cache)["shards"]]).to_dicts()
    return {r["id"]: r for r in rows}


def longest(rows) -> int:
    return max(len(r["prompt_input_ids"]) + len(r[f"{side}_input_ids"]) for r in rows for side in fmt.SIDES)


@pytest.fixture(scope="module")
def tight_cache(tmp_path_factory, llama_dir, dpo_data, dpo_cache):
    """The 40 pairs as a top-k cache computed under a token budget just under twice the longest sequence: a view's
    batches then hold that sequence alone and the shorter ones two or three together."""
    budget = 2 * longest(cached_rows(dpo_cache).values()) - 1
    return precompute_in_process(llama_dir, dpo_data, tmp_path_factory.mktemp("tight") / "cache", top_k=K,
                                 token_budget=budget)


def by_hand(policy, row: dict, side: str) -> torch.Tensor:
    """The policy's plain forward over the unpadded prompt + completion: its log_softmax at the positions that
    predict the completion tokens, [T, vocabulary] (float32 logits, upcast)."""
    ids = row["prompt_input_ids"] + row[f"{side}_input_ids"]
    with torch.no_grad():
        logits = policy(torch.tensor([ids])).logits[0].double()
    return logits.log_softmax(-1)[len(row["prompt_input_ids"]) - 1 : -1]


def few(views) -> list:
    """The views of the row with the longest sequence, the shortest, and the first and last shown."""
    size = lambda v: max(len(v.prompt.ids) + len(p.ids) for p in (v.chosen, v.rejected))
    picked = {id(v): v for v in (max(views, key=size), min(views, key=size), views[0], views[-1])}
    return list(picked.values())


def assert_policys_own(views, cached: dict, policy, top_k: bool = False) -> None:
    """Each view's log-ratios (and KL) are the policy's own values, computed by hand, within TOL."""
    for v in views:
        row = cached[v.id]
        for side in fmt.SIDES:
            logps = by_hand(policy, row, side)
            own = logps.gather(-1, torch.tensor(row[f"{side}_input_ids"])[:, None])[:, 0].numpy()
            ratio = getattr(v, side).ratio
            np.testing.assert_allclose(ratio, own - np.asarray(row[f"{side}_logps"]), atol=TOL, rtol=0,
                                       err_msg=f"{v.id} {side}")
            if top_k:  # KL(policy || reference) over the reference's K ids and the rest
                ids = torch.tensor(np.asarray(row[f"{side}_top_ids"]))
                p_top = logps.gather(-1, ids)
                p_rest = logps.scatter(-1, ids, float("-inf")).logsumexp(-1)
                q_top = torch.tensor(np.asarray(row[f"{side}_top_logps"], np.float64))
                q_rest = torch.tensor(np.asarray(row[f"{side}_tail"], np.float64))
                kl = (p_top.exp() * (p_top - q_top)).sum(-1) + p_rest.exp() * (p_rest - q_rest)
                np.testing.assert_allclose(getattr(v, side).top.kl, kl.numpy(), atol=TOL, rtol=0)
    assert max(np.abs(p.ratio).max() for v in views for p in (v.chosen, v.rejected)) > 0.01  # another model


@pytest.fixture()
def seen(monkeypatch):
    """What a view scores and renders: each padded batch's sequences, and the views the page or console gets."""
    import runtime.logprobs
    from audit import show

    got = {"batches": [], "views": None}
    real_batch, real_html, real_text = runtime.logprobs.padded_scores, show.render_html, show.render_text

    def batch(model, sequences, *args, **kwargs):
        got["batches"].append([list(p) + list(c) for p, c in sequences])
        return real_batch(model, sequences, *args, **kwargs)

    def html(views, *args, **kwargs):
        got["views"] = views
        return real_html(views, *args, **kwargs)

    def text(views, *args, **kwargs):
        got["views"] = views
        return real_text(views, *args, **kwargs)

    monkeypatch.setattr(runtime.logprobs, "padded_scores", batch)
    monkeypatch.setattr(show, "render_html", html)
    monkeypatch.setattr(show, "render_text", text)
    return got


def shown_ratios(page: str, row_index: int, side: str) -> list[float]:
    """The log-ratios printed under one completion's tokens on the page."""
    block = page.split(f'<h2 id="row-{row_index}">', 1)[1].split("<h2 ", 1)[0]
    part = block.split(f'<div class="part {side}">', 1)[1].split("</div>", 1)[0]
    return [float(x) for x in re.findall(r'<small class="(?:up|down)"> ?([+-]?[\d.]+)</small>', part)]


def test_a_page_of_every_row_scores_the_policy_in_batches_with_its_own_values(dpo_cache, policy_dir, policy,
                                                                               llama_dir, seen, tmp_path):
    run = fake_run(tmp_path / "run", policy_dir, dpo_cache)
    page_path = tmp_path / "page.html"
    code, out, err = audit(dpo_cache, "--html", page_path, "--all", "--run", run, "--model", llama_dir)
    assert code == 0, err
    assert "one sequence at a time" not in err
    cached = cached_rows(dpo_cache)
    assert max(len(b) for b in seen["batches"]) == 2 * len(cached)  # the cache's budget holds every sequence at once
    views = seen["views"]
    assert len(views) == len(cached)
    assert_policys_own(few(views), cached, policy)
    page = page_path.read_text()
    for v in views:  # the page prints those values
        for side in fmt.SIDES:
            assert shown_ratios(page, v.index, side) == [float(f"{r:+.3f}") for r in getattr(v, side).ratio]


def test_the_longest_row_alone_in_its_batch_and_a_top_k_caches_kl(tight_cache, policy_dir, policy, llama_dir,
                                                                  seen, tmp_path):
    run = fake_run(tmp_path / "run", policy_dir, tight_cache)
    code, out, err = audit(tight_cache, "--html", tmp_path / "page.html", "--all", "--run", run, "--model", llama_dir)
    assert code == 0, err
    cached = cached_rows(tight_cache)
    top = longest(cached.values())
    alone = [b for b in seen["batches"] if len(b) == 1]
    assert alone and all(len(b[0]) == top for b in alone)  # each sequence of the longest length, and only those
    assert max(len(b) for b in seen["batches"]) >= 2  # the shorter ones padded together
    assert sum(len(b) for b in seen["batches"]) >= 2 * len(cached)
    views = seen["views"]
    alone_rows = [v for v in views if any(len(v.prompt.ids) + len(p.ids) == top for p in (v.chosen, v.rejected))]
    assert_policys_own(list({v.index: v for v in few(views) + alone_rows}.values()), cached, policy, top_k=True)


def test_batches_that_differ_from_the_definition_are_not_used(dpo_cache, policy_dir, policy, llama_dir, seen,
                                                              monkeypatch, tmp_path):
    """A fast path proves itself: batches off by 1e-3 (a wrong padding would be off by far more) fail the probe, the
    rows are scored one sequence at a time by the definition, and the command says so."""
    import dataclasses

    import runtime.logprobs

    spied = runtime.logprobs.padded_scores

    def shifted(*args, **kwargs):
        scores, counts = spied(*args, **kwargs)
        return [dataclasses.replace(s, logps=s.logps + 1e-3) for s in scores], counts

    monkeypatch.setattr(runtime.logprobs, "padded_scores", shifted)
    run = fake_run(tmp_path / "run", policy_dir, dpo_cache)
    code, out, err = audit(dpo_cache, "--html", tmp_path / "page.html", "--sample", 6, "--run", run,
                           "--model", llama_dir)
    assert code == 0, err
    assert ("note: the policy scored one sequence at a time (padded batches not used: differs from the reference "
            "forward by 1.00e-03") in err
    assert len(seen["batches"]) == 1 and len(seen["views"]) == 6  # the probe's batch only
    assert_policys_own(seen["views"], cached_rows(dpo_cache), policy)


def test_a_lora_runs_page_in_batches_is_base_plus_adapter(dpo_cache, llama_dir, seen, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    run = fake_run(tmp_path / "run", make_lora_adapter(llama_dir, tmp_path / "adapter"), dpo_cache)
    code, out, err = audit(dpo_cache, "--html", tmp_path / "page.html", "--sample", 6, "--run", run,
                           "--model", llama_dir)
    assert code == 0, err
    assert len(seen["batches"]) == 2 and "one sequence at a time" not in err  # the probe's batch, then all rows
    policy = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32),
                                            run).eval()
    assert_policys_own(few(seen["views"]), cached_rows(dpo_cache), policy)


def test_a_one_row_view_runs_no_batch_and_imports_no_datasets(dpo_cache, policy_dir, policy, llama_dir, seen,
                                                              tmp_path):
    from test_cli_startup import heavy, run_cli

    run = fake_run(tmp_path / "run", policy_dir, dpo_cache)
    code, out, err = audit(dpo_cache, "--show", "r0002", "--run", run, "--model", llama_dir)
    assert code == 0, err
    assert seen["batches"] == []  # the two sequences by the definition itself, nothing to prove a batch on
    assert [v.id for v in seen["views"]] == ["r0002"]
    assert_policys_own(seen["views"], cached_rows(dpo_cache), policy)
    shown, modules = run_cli("audit.cli", [str(dpo_cache), "--show", "r0002", "--run", str(run), "--model",
                                           str(llama_dir)], tmp_path / "home", tmp_path)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "policy log-ratio chosen - rejected" in shown.stdout
    assert heavy(modules) == ["torch", "transformers"]  # the policy's libraries; no datasets (no --data), no peft
