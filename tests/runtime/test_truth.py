"""The chunked truth (runtime/truth.py): the model's own forward piece by piece equals its whole forward (relative
1e-5, float32: runtime.tolerance.truth_tolerance) on every architecture of the architecture matrix that takes `logits_to_keep`, log-probs and top-k
alike, and never holds more than one piece's logits; the probe uses it only for sequences past WHOLE_ELEMENTS, once
proven on the job's own sequences, and records it; a model without it, or whose pieces differ, keeps the whole
forward and the record says why."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime import probe, truth
from runtime.logprobs import reference_logps, reference_scores
from schemas.encoding import EncodedPair
from runtime.tolerance import truth_tolerance
from test_architectures import ARCHITECTURES, SWEEP, SWEEP_ONLY, VOCAB, build

TOLERANCE = truth_tolerance("float32")  # 1e-5 relative


def sequence(prompt=20, completion=30, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(3, VOCAB, prompt).tolist(), rng.integers(3, VOCAB, completion).tolist()


@pytest.mark.parametrize("name", [n for n in sorted(ARCHITECTURES) if SWEEP or n not in SWEEP_ONLY])
def test_the_chunked_truth_equals_the_whole_forward_on_every_architecture(name):
    model = build(name)
    if not truth.supports_chunks(model):
        assert truth.chosen_truth(model, [sequence()], 0)[0] == set()
        return
    seq = sequence()
    try:
        assert truth.chunked_difference(model, [seq]) <= TOLERANCE
        assert truth.chunked_difference(model, [seq], top_k=4) <= TOLERANCE
    except (TypeError, ValueError, RuntimeError) as e:  # a forward that rejects the pieces: chosen_truth says so
        with pytest.MonkeyPatch.context() as m:
            m.setattr(truth, "WHOLE_ELEMENTS", VOCAB * 10)
            chunked, record = truth.chosen_truth(model, [seq], 0)
        assert chunked == set() and "failed" in record["why"], e


def test_pieces_hold_one_piece_of_logits_and_match_by_hand():
    """The head's output never spans more than a piece's positions; the values equal log_softmax of the whole
    forward's logits gathered at the completion tokens, computed here by hand."""
    model = build("llama")
    prompt, completion = sequence(10, 40)
    seen = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(out.shape[1]))
    scores = truth.chunked_scores(model, prompt, completion, top_k=3, piece_elements=VOCAB * 7)
    handle.remove()
    assert max(seen) <= 7 and sum(seen) == len(completion)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()
    by_hand = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
    assert torch.allclose(scores.logps.double(), by_hand, rtol=0, atol=1e-5)
    whole = reference_scores(model, prompt, completion, 3)
    assert torch.equal(scores.top_ids, whole.top_ids)


def test_the_probe_scores_long_sequences_in_pieces_once_proven_and_records_it(monkeypatch):
    model = build("llama")
    pairs = [EncodedPair(*sequence(4, 5, 1), sequence(1, 6, 2)[1]), EncodedPair(*sequence(30, 40, 3),
                                                                              sequence(1, 35, 4)[1])]
    monkeypatch.setattr(truth, "WHOLE_ELEMENTS", VOCAB * 40)  # the second pair's sequences do not fit
    used = []
    original = truth.chunked_scores
    monkeypatch.setattr(probe, "chunked_scores", lambda *a, **k: used.append(len(a[2])) or original(*a, **k))
    notes = {}
    values = probe.reference_values(model, pairs, notes=notes)
    assert sorted(used) == [35, 40]  # only the long ones
    record = notes["truth"]
    assert record["kind"] == "chunked" and record["long_sequences"] == 2
    assert record["max_relative_difference"] <= TOLERANCE and record["proven_on"] == [10, 9]  # the first pair, longest first
    for value, (p, c) in zip(values, [(q.prompt_ids, x) for q in pairs for x in (q.chosen_ids, q.rejected_ids)]):
        assert np.allclose(value, reference_logps(model, p, c).numpy(), rtol=1e-6, atol=1e-6)
    short = {}
    probe.reference_values(model, pairs[:1], notes=short)
    assert short == {}  # everything fits: the whole forward, nothing to record


def test_a_model_whose_pieces_differ_keeps_the_whole_forward(monkeypatch):
    model = build("llama")
    monkeypatch.setattr(truth, "WHOLE_ELEMENTS", VOCAB * 40)
    original = truth.chunked_scores

    def off(*args, **kwargs):
        scores = original(*args, **kwargs)
        scores.logps = scores.logps * (1 + 1e-3)  # a head path that is not the model's own numbers
        return scores

    monkeypatch.setattr(truth, "chunked_scores", off)
    chunked, record = truth.chosen_truth(model, [sequence(4, 5), sequence(30, 40)], 0)
    assert chunked == set() and record["kind"] == "whole forward" and "differs" in record["why"]
    assert record["max_relative_difference"] > TOLERANCE


def test_the_proof_uses_the_longest_fitting_sequences_or_a_prefix_that_fits(monkeypatch):
    model = build("llama")
    monkeypatch.setattr(truth, "WHOLE_ELEMENTS", VOCAB * 40)
    short, mid, long = sequence(3, 4), sequence(10, 20), sequence(30, 40)
    assert truth.proof_sequences(model, [short, long, mid]) == [mid, short]
    (prompt, completion), = truth.proof_sequences(model, [long])
    assert truth.fits(model, prompt, completion) and prompt == long[0][: len(prompt)]
    assert completion == long[1][: len(completion)]


def test_precompute_ref_records_the_chunked_truth_and_writes_the_same_cache(tmp_path, monkeypatch):
    """precompute-ref on data/'s model with WHOLE_ELEMENTS lowered so the job's longest sequences do not fit: the
    probe's truth is the chunked one, recorded in the manifest's computation (a note: the shards and their values
    are those of the job run with the whole forward), and the summary says so."""
    import json

    from conftest import DATA, manifest_of, precompute_in_process, read_cache

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join((DATA / "prefs" / "train.jsonl").read_text().splitlines(keepends=True)[:12]))
    whole = precompute_in_process(DATA / "sft-model", data, tmp_path / "whole", top_k=4)
    monkeypatch.setattr(truth, "WHOLE_ELEMENTS", 1024 * 24)
    chunked = precompute_in_process(DATA / "sft-model", data, tmp_path / "chunked", top_k=4)
    record = manifest_of(chunked)["computation"]["truth"]
    assert record["kind"] == "chunked" and record["max_relative_difference"] <= TOLERANCE
    assert record["long_sequences"] >= 1 and all(n * 1024 <= 1024 * 24 for n in record["proven_on"])
    assert "truth" not in manifest_of(whole)["computation"]
    a, b = read_cache(whole), read_cache(chunked)
    for column in ("chosen_logps", "rejected_logps", "chosen_top_logps", "rejected_top_logps"):
        assert a[column].to_list() == b[column].to_list(), column
    assert json.loads(json.dumps(record)) == record  # plain JSON in the manifest
