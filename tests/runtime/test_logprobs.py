"""runtime/logprobs.py against an independent computation: a plain transformers forward of each unpadded sequence,
log_softmax over the whole vocabulary, the target token picked by hand. Covers `completion_logps` on a right-padded
batch, `token_logps` through each head path (with several chunks, with gradients), `reference_logps` and the
reset of a dynamic rotary embedding's state, `pad_sequences` and `unwrap`."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import build_llama
from runtime import logprobs
from runtime.logprobs import completion_logps, pad_sequences, reference_logps, reference_top_k, token_logps, unwrap
from runtime.tolerance import probe_tolerance

VOCAB = 300
PAD = 0
TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    m = build_llama(VOCAB, seed=4)
    with torch.no_grad():  # larger weights than the default init, so positions and context change the numbers
        for p in m.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.2)
    return m


def sequences(n=5, seed=0) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) of several lengths, one-token completions and prompts included."""
    rng = random.Random(seed)
    lengths = [(1, 1), (3, 7), (12, 2), (5, 1), (20, 9)][:n]
    return [([rng.randrange(3, VOCAB) for _ in range(p)], [rng.randrange(3, VOCAB) for _ in range(c)])
            for p, c in lengths]


def plain_with_grad(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The log-probs of the completion tokens from one unpadded forward, written out without the project's code."""
    ids = prompt + completion
    logps = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return torch.stack([logps[len(prompt) + i - 1, t] for i, t in enumerate(completion)])


@torch.no_grad()
def plain(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    return plain_with_grad(model, prompt, completion)


def batch(pairs):
    input_ids, mask = pad_sequences([p + c for p, c in pairs], PAD)
    prompt_lens = torch.tensor([len(p) for p, _ in pairs])
    completion_lens = torch.tensor([len(c) for _, c in pairs])
    return input_ids, mask, prompt_lens, completion_lens


def test_pad_sequences_right_pads_ids_and_mask():
    ids, mask = pad_sequences([[5, 6, 7], [8]], pad_id=9)
    assert ids.tolist() == [[5, 6, 7], [8, 9, 9]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long


@pytest.mark.parametrize("chunk_elements", [2**25, VOCAB * 3])  # one chunk; chunks of 3 positions
def test_completion_logps_equal_a_plain_forward_per_sequence(model, chunk_elements):
    pairs = sequences()
    got = completion_logps(model, *batch(pairs), chunk_elements=chunk_elements)
    expected = torch.cat([plain(model, p, c) for p, c in pairs])  # flattened in row order
    assert got.dtype == torch.float32 and got.shape == expected.shape == (sum(len(c) for _, c in pairs),)
    torch.testing.assert_close(got, expected, rtol=0, atol=TOL)
    assert bool((got < 0).all())


def test_completion_logps_are_not_those_of_a_shifted_or_other_sequence(model):
    """Control: the comparison above would see an off-by-one position or a row mix-up."""
    pairs = sequences()
    with torch.no_grad():
        got = completion_logps(model, *batch(pairs))
    shifted = torch.cat([plain(model, p[:-1], [p[-1]] + c[:-1]) if len(p) > 1 else plain(model, p, c)
                         for p, c in pairs])
    assert float((got - shifted).abs().max()) > 1e-3
    swapped = [(pairs[1][0], pairs[0][1])] + pairs[1:]
    with torch.no_grad():
        assert float((completion_logps(model, *batch(swapped))[0] - got[0]).abs()) > 1e-4


@pytest.mark.parametrize("head", ["hook", "logits_to_keep", "logits"])
def test_token_logps_of_each_head_path_at_arbitrary_positions_and_targets(model, head):
    pairs = sequences()
    input_ids, mask, _, _ = batch(pairs)
    rng = random.Random(1)
    picks = [(r, s, rng.randrange(VOCAB)) for r, (p, c) in enumerate(pairs) for s in range(len(p) + len(c))
             if rng.random() < 0.6]  # any real position of any row, any target token (not only the next one)
    rows, sources, targets = (torch.tensor(x) for x in zip(*picks))
    got = token_logps(model, {"input_ids": input_ids, "attention_mask": mask}, rows, sources, targets,
                      chunk_elements=VOCAB * 4, head=head)
    with torch.no_grad():
        per_row = [model(torch.tensor([p + c])).logits[0].float().log_softmax(-1) for p, c in pairs]
    expected = torch.stack([per_row[r][s, t] for r, s, t in picks])
    torch.testing.assert_close(got, expected, rtol=0, atol=TOL)


def test_chunked_hook_path_gives_the_gradient_of_a_plain_forward(model):
    """With grad enabled and several chunks, each chunk's logits are recomputed in the backward pass; the gradient
    must still be that of the plain log_softmax."""
    pairs = sequences()
    trained = build_llama(VOCAB, seed=4)
    trained.load_state_dict(model.state_dict())
    params = dict(trained.named_parameters())
    got = completion_logps(trained, *batch(pairs), chunk_elements=VOCAB * 2)
    (got * torch.linspace(0.5, 1.5, len(got))).sum().backward()
    grads = {n: p.grad.clone() for n, p in params.items()}
    trained.zero_grad()
    expected = torch.cat([plain_with_grad(trained, p, c) for p, c in pairs])
    (expected * torch.linspace(0.5, 1.5, len(got))).sum().backward()
    for name, p in params.items():  # float32 rounding of a padded batch vs one sequence: ~1e-6 of the largest
        scale = float(p.grad.abs().max())
        assert float((grads[name] - p.grad).abs().max()) <= 1e-5 * max(1.0, scale), name
    assert max(float(g.abs().max()) for g in grads.values()) > 0


@pytest.mark.parametrize("head", ["hook", "logits_to_keep", "logits"])
def test_cpu_pieces_of_the_head_give_the_plain_forwards_values_and_gradient(model, monkeypatch, head):
    """On CPU the head scores cache-sized pieces of a memory chunk (here 2 positions a piece, one chunk for all):
    values within the house tolerance of a plain forward's log_softmax, the gradient that of the plain forward, and
    no recomputation in the backward (the whole chunk fits the memory bound)."""
    monkeypatch.setattr(logprobs, "CPU_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(logprobs, "CPU_CHUNK_ROWS", 2)
    pieces, checkpoints = [], []
    scores, checkpoint = logprobs._scores, logprobs.checkpoint
    monkeypatch.setattr(logprobs, "_scores", lambda logits, *a, **kw: pieces.append(len(logits)) or scores(logits, *a, **kw))
    monkeypatch.setattr(logprobs, "checkpoint", lambda *a, **kw: checkpoints.append(1) or checkpoint(*a, **kw))
    pairs = sequences()
    trained = build_llama(VOCAB, seed=4)
    trained.load_state_dict(model.state_dict())
    input_ids, mask, plen, clen = batch(pairs)
    rows = torch.repeat_interleave(torch.arange(len(pairs)), clen)
    sources = torch.cat([torch.arange(len(p) - 1, len(p) + len(c) - 1) for p, c in pairs])
    targets = torch.tensor([t for _, c in pairs for t in c])
    weights = torch.linspace(0.5, 1.5, len(targets))
    got = token_logps(trained, {"input_ids": input_ids, "attention_mask": mask}, rows, sources, targets, head=head)
    assert pieces and max(pieces) == 2 and sum(pieces) == len(targets) and not checkpoints
    (got * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in trained.named_parameters()}
    trained.zero_grad()
    expected = torch.cat([plain_with_grad(trained, p, c) for p, c in pairs])
    assert float((got.detach() - expected.detach()).abs().max()) <= probe_tolerance(torch.float32)
    (expected * weights).sum().backward()
    for name, p in trained.named_parameters():
        assert float((grads[name] - p.grad).abs().max()) <= 1e-5 * max(1.0, float(p.grad.abs().max())), name


def test_cpu_pieces_are_cache_sized_within_the_memory_chunk():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert logprobs._piece(4096, 8192, 0, cpu) == logprobs.CPU_CHUNK_ELEMENTS // 8192 == 256
    assert logprobs._piece(32768, 1024, 0, cpu) == 2048  # a small vocabulary: more positions, the same elements
    assert logprobs._piece(1048, 32000, 0, cpu) == logprobs.CPU_CHUNK_ROWS  # at least that many positions
    assert logprobs._piece(128, 2**18, 0, cpu) == 128  # never beyond the memory chunk
    assert logprobs._piece(4096, 2048, 8, cpu) == logprobs.CPU_CHUNK_ELEMENTS // (2 * 2048)  # exp held beside
    assert logprobs._piece(4096, 8192, 0, cuda) == 4096  # on a GPU the memory chunk itself


def test_reference_logps_is_the_plain_forward(model):
    for p, c in sequences():
        torch.testing.assert_close(reference_logps(model, p, c), plain(model, p, c), rtol=0, atol=TOL)


@torch.no_grad()
def whole_forward_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """reference_logps as it was before the head ran on the completion positions only: logits at every position,
    one log_softmax over all the completion positions."""
    logits = model(input_ids=torch.tensor([prompt + completion]), use_cache=False).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.mark.parametrize("chunk_elements", [logprobs.CHUNK_ELEMENTS, 2 * VOCAB])  # one chunk; 2 positions a chunk
def test_reference_logps_are_the_whole_forward_whatever_the_chunks(model, monkeypatch, chunk_elements):
    """log_softmax a chunk of positions at a time gives the very numbers of the whole forward (bit for bit), and the
    head runs on every position of the sequence: the definition takes no head path (logits_to_keep is one of the
    paths checked against it)."""
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", chunk_elements)
    rows = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    try:
        for p, c in sequences():
            rows.clear()
            got = reference_logps(model, p, c)
            assert rows == [len(p) + len(c)]
            assert torch.equal(got, whole_forward_logps(model, p, c))
    finally:
        handle.remove()


def test_reference_logps_resets_a_dynamic_rotary_embedding():
    """A dynamic-NTK rotary embedding grows its frequencies for the longest sequence it has seen and keeps them; the
    reference is the fresh model's numbers whatever ran before."""
    threshold = 16
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    model = LlamaForCausalLM(LlamaConfig(  # dynamic NTK takes max_position_embeddings as its original context
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=threshold,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.25)
    rng = random.Random(3)
    # 24 tokens: past the original context, shorter than what ran before (transformers resets by itself only for
    # sequences inside the original context)
    prompt, completion = [rng.randrange(3, VOCAB) for _ in range(10)], [rng.randrange(3, VOCAB) for _ in range(14)]
    fresh = plain(model, prompt, completion)  # nothing longer has run yet
    assert torch.allclose(reference_logps(model, prompt, completion), fresh, rtol=0, atol=TOL)

    with torch.no_grad():
        model(torch.tensor([[rng.randrange(3, VOCAB) for _ in range(threshold * 4)]]))  # past the original context
    stale = plain(model, prompt, completion)
    assert float((stale - fresh).abs().max()) > 1e-4  # the state it kept changes a short sequence's numbers

    torch.testing.assert_close(reference_logps(model, prompt, completion), fresh, rtol=0, atol=TOL)
    torch.testing.assert_close(plain(model, prompt, completion), fresh, rtol=0, atol=TOL)  # left fresh after


def test_unwrap_finds_the_model_inside_wrappers(model):
    class Wrapper(torch.nn.Module):  # what DDP / FSDP look like from outside: the model as .module
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    compiled = type("Compiled", (), {"_orig_mod": model})()
    assert unwrap(Wrapper(Wrapper(model))) is model and unwrap(compiled) is model and unwrap(model) is model


@torch.no_grad()
@pytest.mark.parametrize("k", [1, 8, VOCAB - 1, VOCAB])
def test_reference_top_k_is_the_plain_forwards_sorted_distribution(model, k):
    """Ids and log-probs against a float64 sort of the plain forward's softmax; the tail against the float64 sum of
    the probabilities left out (exactly 0 mass, -inf, when k is the whole vocabulary)."""
    import numpy as np

    for prompt, completion in sequences():
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
        probs = logits.softmax(-1).numpy()
        top_ids, top_logps, tail = reference_top_k(model, prompt, completion, k)
        assert top_ids.shape == top_logps.shape == (len(completion), k) and tail.shape == (len(completion),)
        for t in range(len(completion)):
            order = np.argsort(-probs[t], kind="stable")[:k]
            assert top_ids[t].tolist() == order.tolist()
            assert np.allclose(top_logps[t].numpy(), np.log(probs[t][order]), atol=TOL)
            left = np.delete(probs[t], order).sum()
            assert (tail[t] == float("-inf")) if k == VOCAB else abs(float(tail[t]) - np.log(left)) < 1e-4
        assert torch.equal(top_logps[:, 0] >= top_logps[:, -1], torch.ones(len(completion), dtype=torch.bool))


@pytest.mark.parametrize("k", [5, 64])
def test_top_k_scores_and_gradient_with_tails_far_below_the_top(k):
    """One chunk's scores at the top k and at given ids (logprobs._scores) against float64 autograd, on rows whose
    tail is hundreds of nats below their top tokens (exp(x - max) underflows there, so those rows take the rescaled
    path) beside ordinary rows; at k = the vocabulary the tail is -inf with a zero, finite gradient."""
    from runtime.logprobs import _scores

    vocab, n = 64, 12
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(n, vocab, generator=gen) * 3
    logits[::3, :4] += 300.0  # every third row: four tokens hold all but ~e^-290 of the mass
    targets = torch.randint(0, vocab, (n,), generator=gen)
    upstream = [torch.randn(n, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)]
    # given ids in random order; on the far rows they hold the four top tokens, so their tail is the far one
    given = torch.stack([torch.randperm(vocab, generator=gen)[:k] if i % 3 else
                         torch.cat([torch.arange(4), 4 + torch.randperm(vocab - 4, generator=gen)])[:k].flip(0)
                         for i in range(n)])
    for ids_in in (None, given):
        x = logits.clone().requires_grad_()
        logps, ids, picked, tail = _scores(x, targets, k, ids_in)
        finite = torch.where(torch.isinf(tail), 0.0, tail)
        ((logps * upstream[0]).sum() + (picked * upstream[1]).sum() + (finite * upstream[2]).sum()).backward()

        x64 = logits.double().requires_grad_()
        full = x64.log_softmax(-1)
        rest = full.scatter(-1, ids, float("-inf")).logsumexp(-1)
        rest_finite = torch.where(torch.isinf(rest), 0.0, rest)
        ((full.gather(-1, targets[:, None])[:, 0] * upstream[0]).sum() + (full.gather(-1, ids) * upstream[1]).sum()
         + (rest_finite * upstream[2]).sum()).backward()

        assert float((logps.detach().double() - full.gather(-1, targets[:, None])[:, 0]).abs().max()) < 1e-4
        assert float((picked.detach().double() - full.gather(-1, ids)).abs().max()) < 1e-4
        assert torch.equal(torch.isneginf(tail), torch.isneginf(rest)) and torch.isneginf(tail).all() == (k == vocab)
        assert float((finite.detach().double() - rest_finite).abs().max() / rest_finite.abs().max().clamp(min=1)) < 1e-6
        if k < vocab:
            assert float(tail[::3].max()) < -250  # the far tails are there, not lost to underflow (-inf)
        assert torch.isfinite(x.grad).all()
        assert float((x.grad.double() - x64.grad).abs().max()) < TOL * max(1.0, float(x64.grad.abs().max()))


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="torch.compile on CPU needs g++")
def test_compiled_model_scores_batches_of_new_shapes_without_recompiling():
    """Under torch.compile (as the Trainer and precompute-ref --torch-compile wrap the model) the chunked head's hook
    runs eagerly: batches of new shapes reuse the dynamic graph instead of compiling one per batch, the values are
    the eager model's within the float32 probe tolerance, and the truth (reference_logps) runs on the eager module."""
    from torch._dynamo.utils import counters

    model = build_llama(64, seed=4)
    compiled = torch.compile(model)  # dynamic=None, the Trainer's: static first, dynamic at the first new shape
    assert logprobs.uncompiled(compiled) is model and unwrap(compiled) is model
    gen = random.Random(0)

    def batch(n, width):
        seqs = [[gen.randrange(3, 64) for _ in range(width - i)] for i in range(n)]
        ids, mask = pad_sequences(seqs, 0)
        return ids, mask, torch.full((n,), 3), torch.tensor([len(s) - 3 for s in seqs])

    graphs = []
    with torch.no_grad():
        for n, width in ((2, 9), (3, 14), (4, 21), (2, 30)):
            args = batch(n, width)
            got, want = completion_logps(compiled, *args), completion_logps(model, *args)
            assert float((got - want).abs().max()) <= 1e-4
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[-1] == graphs[1]  # after the dynamic graph, no new one per batch
    truth = reference_logps(compiled, [5, 6, 7], [8, 9])
    assert torch.equal(truth, reference_logps(model, [5, 6, 7], [8, 9]))  # bitwise: the same eager forward
