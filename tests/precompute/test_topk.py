"""precompute-ref --top-k K: per completion token the reference's K most probable ids, their log-probs and the tail
(log of the mass outside them), in every batching mode and head path, checked against an independent plain forward;
the stored precision; K = 0 byte-identical to the cache before top-k existed; a rerun with another K refused; the
probe turning down a mode whose top-k is wrong."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from precompute import modes
from support import encoded_job
from precompute.modes import REGISTRY, choose_mode, score_pairs
from runtime import logprobs
from schemas import format as fmt
from schemas.cache import open_cache
from schemas.encoding import EncodingConfig

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "faults"))
from faultkit import precompute  # noqa: E402

K = 5


@pytest.fixture(scope="module")
def setup(llama_dir, tmp_path_factory):
    return encoded_job(llama_dir, tmp_path_factory, "topk", 10, seed=5)


def plain_top_k(model, prompt, completion, k):
    """Independent truth: one unpadded forward, log_softmax in float64, sorted; the tail summed in float64."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = model(ids).logits[0, len(prompt) - 1 : -1].double().log_softmax(-1)
    order = logp.argsort(-1, descending=True)
    top = order[:, :k]
    rest = logp.gather(-1, order[:, k:])
    tail = rest.exp().sum(-1).log() if k < logp.shape[-1] else torch.full((logp.shape[0],), -np.inf, dtype=torch.float64)
    return logp, top.numpy(), logp.gather(-1, top).numpy(), tail.numpy()


def assert_top_k(got: fmt.TokenScores, model, prompt, completion, k, value_tol=1e-5):
    """ids exactly, except between values tied within the tolerance (at the boundary too); values and tail."""
    full, ids, values, tail = plain_top_k(model, prompt, completion, k)
    assert got.top_ids.shape == ids.shape == got.top_logps.shape and got.tail.shape == tail.shape
    assert np.abs(got.top_logps - values).max() <= value_tol  # sorted values: ties do not matter
    differ = got.top_ids != ids
    if differ.any():  # a different id must carry the same true log-prob (a tie)
        true_of_got = full.gather(-1, torch.as_tensor(got.top_ids)).numpy()
        assert np.abs(true_of_got - values)[differ].max() <= value_tol
    assert all(len(set(row)) == k for row in got.top_ids.tolist())  # unique per position
    finite = np.isfinite(tail)
    assert (np.isfinite(got.tail) == finite).all()
    assert np.abs(got.tail[finite] - tail[finite]).max(initial=0) <= value_tol
    # the log-prob of the dataset's own token agrees with its entry where it is in the top k
    at = got.top_ids == np.asarray(completion)[:, None]
    assert np.abs(np.broadcast_to(got.logps[:, None], at.shape)[at] - got.top_logps[at]).max(initial=0) <= value_tol


# ---------------------------------------------------------------------------------------------------------------
# every mode, every head path


@pytest.mark.parametrize("head", logprobs.HEADS)
@pytest.mark.parametrize("mode", list(REGISTRY))
def test_top_k_equals_the_plain_forward(setup, mode, head, monkeypatch):
    model, pairs, pad, _ = setup
    monkeypatch.setattr(model, "_refcache_head", head, raising=False)  # the head path verified_head would cache
    # every pair (the longest included), a small budget: several batches of mixed widths
    chosen, rejected, _ = score_pairs(model, pairs, pad, 96, mode, top_k=K)
    assert len(chosen) == len(rejected) == len(pairs)
    for pair, c, r in zip(pairs, chosen, rejected):
        for got, completion in ((c, pair.chosen_ids), (r, pair.rejected_ids)):
            assert_top_k(got, model, pair.prompt_ids, completion, K)
    k0, _, _ = score_pairs(model, pairs, pad, 96, mode)  # K = 0: the same log-probs, bit for bit, nothing else
    assert all(a.top_ids is None and np.array_equal(a.logps, b.logps) for a, b in zip(k0, chosen))


def test_k_equal_to_the_vocabulary_is_the_whole_distribution(setup):
    model, pairs, pad, _ = setup
    vocab = model.get_output_embeddings().weight.shape[0]
    chosen, _, _ = score_pairs(model, pairs[:3], pad, 4096, "full_forward", top_k=vocab)
    for pair, c in zip(pairs, chosen):
        assert np.isneginf(c.tail).all()
        assert_top_k(c, model, pair.prompt_ids, pair.chosen_ids, vocab)
        assert np.abs(np.exp(c.top_logps.astype(np.float64)).sum(-1) - 1).max() < 1e-5


def test_the_chunked_head_never_holds_more_than_a_chunk(setup, monkeypatch):
    """The hook path takes each chunk's top-k before projecting the next: no [positions x vocab] for the batch."""
    model, pairs, pad, _ = setup
    vocab = model.get_output_embeddings().weight.shape[0]
    seen = []
    real = logprobs._project
    monkeypatch.setattr(logprobs, "_project", lambda inner, h: seen.append(h.shape[0]) or real(inner, h))
    ids = torch.tensor([pairs[0].prompt_ids + pairs[0].chosen_ids])
    at = torch.arange(len(pairs[0].prompt_ids), ids.shape[1])
    whole = logprobs.token_scores(model, {"input_ids": ids}, torch.zeros_like(at), at - 1, ids[0, at], head="hook",
                                  top_k=K)
    chunk = 2 * vocab * 2  # two positions per chunk with a top-k (half of chunk_elements)
    seen.clear()
    parts = logprobs.token_scores(model, {"input_ids": ids}, torch.zeros_like(at), at - 1, ids[0, at], head="hook",
                                  top_k=K, chunk_elements=chunk)
    assert len(at) > 2 and max(seen) == 2 and sum(seen) == len(at)
    for name, value in whole.fields().items():
        assert torch.allclose(value.double(), parts.fields()[name].double(), atol=1e-6), name


# ---------------------------------------------------------------------------------------------------------------
# the stored columns


def test_codes_keep_log_probs_within_the_stated_error():
    rng = np.random.default_rng(0)
    values = np.concatenate([-rng.random(200_000) * 24, -24 * np.exp(rng.random(20_000) * 7.9), [0.0, -0.0, 1e-8]])
    values = values.astype(np.float32).astype(np.float64)  # what is stored is float32
    back = fmt.decode_logps(fmt.encode_logps(values)).astype(np.float64)
    near = values >= -24
    # the code's step, plus the float32 rounding of the decoded value (an ulp of 24 is 2e-6)
    assert np.abs(back - np.minimum(values, 0))[near].max() <= fmt.LOGP_ERROR + 2e-6
    assert (np.abs(back - values)[~near] / np.abs(values[~near])).max() <= 2.45e-4
    assert np.isneginf(fmt.decode_logps(fmt.encode_logps([-np.inf]))).all()
    with pytest.raises(ValueError, match="NaN"):
        fmt.encode_logps([np.nan])


def coarse_kl(p_logps, p_tail, q_logps, q_tail):
    """KL(p || q) of two distributions coarsened to p's top-k tokens plus one bucket for the rest (float64)."""
    kl = (np.exp(p_logps) * (p_logps - q_logps)).sum(-1)
    pt = np.exp(p_tail)
    with np.errstate(divide="ignore", invalid="ignore"):
        return kl + np.where(pt > 0, pt * (p_tail - q_tail), 0.0)


def test_a_top_k_cache_reads_back_in_logical_types_and_moves_kl_by_less_than_1e_3(setup, tmp_path, llama_dir):
    from dpo.verify import check_values

    model, pairs, pad, data = setup
    out = tmp_path / "cache"
    result = precompute("--model", llama_dir, "--data", data, "--out", out, "--top-k", 16, "--rows-per-shard", 6)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / fmt.MANIFEST).read_text())
    assert manifest["computation"]["top_k"] == 16
    cache = open_cache(out)
    table = cache.scan()
    assert table.schema.field("chosen_top_ids").type == pa.list_(pa.list_(pa.int32()))
    assert table.schema.field("rejected_top_logps").type == pa.list_(pa.list_(pa.float32()))
    assert table.schema.field("chosen_tail").type == pa.list_(pa.float32())
    stored = pq.read_schema(out / "shard-00000.parquet")  # what the file holds is the storage, not the contract
    assert stored.field("chosen_top_logps").type == pa.list_(pa.uint16())
    joined = check_values(cache, table.column("id").to_pylist())
    assert {f"ref_{c}" for c in fmt.per_token_columns(16)} == set(joined.column_names)
    # a policy that differs from the reference: the same model with its weights moved
    policy = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    worst, ids = 0.0, table.column("id").to_pylist()
    rows = {r["id"]: r for r in joined.append_column("id", pa.array(ids)).to_pylist()}
    for n, pair in enumerate(pairs):
        for side, completion in (("chosen", pair.chosen_ids), ("rejected", pair.rejected_ids)):
            row = rows[f"r{n:04d}"]
            top_ids = np.array(row[f"ref_{side}_top_ids"])
            ref, exact_ids, exact, exact_tail = plain_top_k(model, pair.prompt_ids, completion, 16)
            assert np.array_equal(top_ids, exact_ids)
            kept, kept_tail = np.array(row[f"ref_{side}_top_logps"], np.float64), np.array(row[f"ref_{side}_tail"])
            assert np.abs(kept - exact).max() <= 2 * fmt.LOGP_ERROR * 1.01 + 1e-6  # rounded, then normalised (FORMAT.md)
            q_full = plain_top_k(policy, pair.prompt_ids, completion, 16)[0]
            q = q_full.gather(-1, torch.as_tensor(top_ids)).numpy()
            q_tail = np.log1p(-np.minimum(np.exp(q).sum(-1), 1 - 1e-12))
            for forward in (True, False):
                a = coarse_kl(exact, exact_tail, q, q_tail) if forward else coarse_kl(q, q_tail, exact, exact_tail)
                b = coarse_kl(kept, kept_tail, q, q_tail) if forward else coarse_kl(q, q_tail, kept, kept_tail)
                worst = max(worst, float(np.abs(a - b).max()))
    print(f"largest KL movement from the stored precision: {worst:.2e} nats per token")
    assert worst < 1e-3 / 4  # per token, either direction; the bound in FORMAT.md is 2.5e-4 x (1 + |log ratio|)


# ---------------------------------------------------------------------------------------------------------------
# K = 0: the cache as it was; another K: refused


@pytest.mark.parametrize("mode", ["full_forward", "kv_cache"])
def test_k0_writes_the_cache_as_before_top_k(tmp_path, mode):
    """K = 0 writes the cache as it was before --top-k existed: no top-k column, no `top_k` key in the manifest or
    the shards' footers, every other column and computation key as a top-k run of the same rows writes them, and the
    same bytes on a rerun. Compared with what this test computes here, never with bytes recorded on another machine
    (a forward's float bits differ between CPUs' kernels). A fixed --token-budget: the automatic one follows the
    memory free at the time, and other batches give other float bits."""
    data = tmp_path / "sub.jsonl"
    data.write_text("".join((REPO / "data/prefs/train.jsonl").read_text().splitlines(keepends=True)[:16]))
    caches = {}
    for name, k in (("k0", None), ("k0-again", 0), ("k4", 4)):
        out = tmp_path / name
        result = precompute("--model", REPO / "data/sft-model", "--data", data, "--out", out, "--rows-per-shard", 8,
                            "--batching", mode, "--token-budget", 4096, *(() if k is None else ("--top-k", k)))
        assert result.exit_code == 0, result.output
        caches[name] = (out, json.loads((out / fmt.MANIFEST).read_text()))
    (k0, m0), (_, m_again), (k4, m4) = caches["k0"], caches["k0-again"], caches["k4"]
    assert "top_k" not in m0["computation"] and m4["computation"]["top_k"] == 4
    assert m0["computation"] == {k: v for k, v in m4["computation"].items() if k != "top_k"}
    assert [s["sha256"] for s in m0["shards"]] == [s["sha256"] for s in m_again["shards"]]
    assert [hashlib.sha256((k0 / s["file"]).read_bytes()).hexdigest() for s in m0["shards"]] == \
        [s["sha256"] for s in m0["shards"]]
    for s0, s4 in zip(m0["shards"], m4["shards"]):
        t0, t4 = pq.read_table(k0 / s0["file"]), pq.read_table(k4 / s4["file"])
        top_k_names = {f"{side}_{suffix}" for side in fmt.SIDES for suffix in fmt.TOP_K_COLUMNS}
        assert t0.column_names == [c for c in t4.column_names if c not in top_k_names]
        assert not top_k_names & set(t0.column_names)
        for name in t0.column_names:  # the log-probs within the float32 guarantee: K changes the head's pieces
            a, b = t0.column(name).to_pylist(), t4.column(name).to_pylist()
            if name.endswith("_logps") or name.endswith("_logp"):
                assert np.allclose(np.concatenate([np.ravel(x) for x in a]).astype(float),
                                   np.concatenate([np.ravel(x) for x in b]).astype(float), atol=1e-4, rtol=0), name
            else:
                assert a == b, name
        footer = {k.decode(): v.decode() for k, v in (t0.schema.metadata or {}).items()}
        assert all("top_k" not in json.loads(v) for k, v in footer.items() if k.endswith("computation")), footer


def test_a_rerun_with_another_k_is_refused(setup, tmp_path, llama_dir):
    _, _, _, data = setup
    for first, then in ((0, 4), (4, 8), (4, 0)):
        out = tmp_path / f"c{first}-{then}"
        args = ("--model", llama_dir, "--data", data, "--out", out, "--rows-per-shard", 6, "--batching", "full_forward")
        assert precompute(*args, "--top-k", first).exit_code == 0
        (out / fmt.MANIFEST).unlink()  # an interrupted run: only shards to judge
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        result = precompute(*args, "--top-k", then)
        assert result.exit_code == 2, result.output
        assert f"the cache: --top-k {first}" in result.output and f"this run:  --top-k {then}" in result.output, result.output
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing written or deleted
        assert precompute(*args, "--top-k", first).exit_code == 0  # the recorded K resumes


def test_k_above_the_vocabulary_is_refused(setup, tmp_path, llama_dir):
    _, _, _, data = setup
    result = precompute("--model", llama_dir, "--data", data, "--out", tmp_path / "c", "--top-k", 100000)
    assert result.exit_code == 2 and "--top-k 100000 is more than the model's vocabulary" in result.output


# ---------------------------------------------------------------------------------------------------------------
# the probe


@pytest.mark.parametrize("damage", ["values", "ids", "tail"])
def test_the_probe_turns_down_a_mode_whose_top_k_is_wrong(setup, monkeypatch, damage):
    model, pairs, pad, _ = setup
    mode = REGISTRY["kv_cache"]
    real = type(mode).score

    def wrong(self, model_, pairs_, batch, pad_id, top_k=0):
        order, values, counts = real(self, model_, pairs_, batch, pad_id, top_k)
        for v in values:
            if top_k and damage == "values":
                v.top_logps = v.top_logps + 0.01
            elif top_k and damage == "ids":
                v.top_ids = v.top_ids[:, ::-1].copy()
            elif top_k:
                v.tail = v.tail + 0.01
        return order, values, counts

    monkeypatch.setattr(type(mode), "score", wrong)
    messages = []
    assert choose_mode(model, "kv_cache", pairs, 99, pad, 4096, messages.append) == "kv_cache"  # log-probs fine
    messages.clear()
    assert choose_mode(model, "kv_cache", pairs, 99, pad, 4096, messages.append, top_k=K) == "full_forward"
    want = {"values": "top-k log-probs differ from the reference forward by 1.00e-02",
            "ids": "top-k ids differ from the reference forward", "tail": "the top-k tail differs"}[damage]
    assert f"kv_cache: {want}" in messages[0], messages
    assert modes.FALLBACK[0] == "full_forward"


def test_any_top_k_values_read_back_as_written(tmp_path):
    """The storage is lossless but for the codes' rounding, whatever the order of the values (the writer stores
    each code's step from the one before, modulo 2**16); a stored column that is not K per token is refused."""

    rng = np.random.default_rng(1)
    k, lengths = 3, [4, 1, 6]
    scores = [fmt.TokenScores(-rng.random(n).astype(np.float32) * 3, rng.integers(0, 50000, (n, k)).astype(np.int32),
                              (-rng.random((n, k)) * 40).astype(np.float32), np.log(rng.random(n)).astype(np.float32))
              for n in lengths]
    scores[0].top_logps[0] = [-np.inf, 0.0, -1e5]  # unsorted, infinite, past the codes' range
    ids = [[5] * n for n in lengths]
    table = fmt.shard_table(["a", "b", "c"], [[1, 2]] * 3, ids, ids[::-1], scores, scores[::-1], top_k=k)
    path = tmp_path / "shard-00000.parquet"
    fmt.write_shard(path, table, model_hash="m", tokenizer_hash="t", encoding=EncodingConfig(),
                    computation={"top_k": k})
    back = fmt.read_columns(path).to_pydict()
    for row, s in enumerate(scores):
        assert np.array_equal(np.array(back["chosen_top_ids"][row]), s.top_ids)
        assert np.array_equal(np.array(back["chosen_tail"][row], np.float32), s.tail)
        got, want = np.array(back["chosen_top_logps"][row], np.float64), s.top_logps.astype(np.float64)
        finite = np.isfinite(want) & (want > -71000)
        assert np.isneginf(got[np.isneginf(want)]).all()
        error = np.abs(got[finite] - want[finite])
        assert (error <= np.maximum(fmt.LOGP_ERROR + 2e-6, 2.45e-4 * np.abs(want[finite]))).all()
    assert back["rejected_top_ids"][0] == back["chosen_top_ids"][2]
    with pytest.raises(ValueError, match="3 values per completion token"):
        fmt.shard_table(["a"], [[1]], [[5, 5]], [[5]], [scores[1]], [scores[1]], top_k=k)
    torn = table.set_column(table.column_names.index("chosen_top_logps"), "chosen_top_logps",
                            pa.array([[1, 2], [3, 4, 5], [6, 7, 8]], pa.list_(pa.uint16())))
    pq.write_table(torn.replace_schema_metadata(pq.read_schema(path).metadata), path)
    with pytest.raises(fmt.CacheError, match="does not hold 3 values per token"):
        fmt.read_columns(path)
