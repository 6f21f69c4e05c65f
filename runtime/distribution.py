"""The distribution of one chunk of float32 logits that a top-k cache stores and a top-k loss trains against: the
log-probs at the targets, at K ids per position and of the mass outside them (the tail), from one pass over the
vocabulary, as a torch autograd function with its closed-form backward (one [n, V] tensor). `runtime.logprobs._scores`
calls it; its values and gradient are checked against float64 autograd (tests/runtime/test_logprobs.py)."""

from __future__ import annotations

import torch


# A tail sum below this (relative to the largest logit's term) is recomputed against its own largest term: exp(x - max)
# would lose it to underflow. Above it, the largest term outside the ids is a normal float32 for any vocabulary below
# 2**40, so the sum keeps float32's relative precision.
_TAIL_RESCALE = 2.0**-64


class _Distribution(torch.autograd.Function):
    """logps [n], picked [n, K] and tail [n] of float32 logits [n, V] at `targets` [n] and `ids` [n, K]: x_t - N,
    x_ids - N and log(sum over v outside ids of exp(x_v)) - N, N = logsumexp(x), from one exp(x - max) per chunk.

    N is torch.logsumexp's own arithmetic (the max, exp(x - max), its sum, log + max: bit for bit, so logps equal
    the plain path's), and the tail sums the same exp(x - max) with the ids zeroed, so the distribution costs one
    pass over the vocabulary more than the log-probs alone, not a second masked copy and log-sum-exp. Rows whose
    tail is too small for that sum (_TAIL_RESCALE; also rows whose ids cover the vocabulary) are recomputed as a
    log-sum-exp over a masked copy of their own logits. The backward is the closed form, one [n, V] tensor:
    d/dx_v = [v = t] g_logps + sum_j [v = id_j] g_picked_j + [v not in ids] g_tail q_v - G p_v, with p the softmax,
    q the softmax over the tokens outside the ids and G = g_logps + sum g_picked + g_tail."""

    @staticmethod
    def forward(ctx, logits, targets, ids):
        top = logits.amax(-1, keepdim=True)
        top = top.masked_fill(top.abs() == float("inf"), 0.0)  # as torch.logsumexp
        e = (logits - top).exp_()
        s = e.sum(-1, keepdim=True)
        norm = s.log() + top
        logps = logits.gather(-1, targets[:, None]).squeeze(-1) - norm[:, 0]
        picked = logits.gather(-1, ids) - norm
        e.scatter_(-1, ids, 0.0)
        r = e.sum(-1)
        tail = r.log() + top[:, 0] - norm[:, 0]
        again = (r < _TAIL_RESCALE).nonzero()[:, 0]
        others, rest = logits.new_zeros(0, logits.shape[1]), logits.new_zeros(0)
        if len(again):
            others = logits[again].scatter(-1, ids[again], float("-inf"))
            empty = torch.isneginf(others).all(-1)
            rest = torch.where(empty, float("-inf"), torch.where(empty[:, None], 0.0, others).logsumexp(-1))
            tail[again] = rest - norm[again, 0]
        ctx.save_for_backward(e, s, r, picked, targets, ids, again, others, rest)
        return logps, picked, tail

    @staticmethod
    def backward(ctx, g_logps, g_picked, g_tail):
        e, s, r, picked, targets, ids, again, others, rest = ctx.saved_tensors
        g_logps = torch.zeros_like(r) if g_logps is None else g_logps
        g_picked = torch.zeros_like(picked) if g_picked is None else g_picked
        g_tail = torch.zeros_like(r) if g_tail is None else g_tail
        total = g_logps + g_picked.sum(-1) + g_tail
        on_tail = torch.where(r > 0, g_tail / r, 0.0).index_fill(0, again, 0.0)
        grad = e * (on_tail - total / s[:, 0])[:, None]  # outside the ids (e is 0 at them)
        grad.scatter_(-1, ids, -total[:, None] * picked.exp())  # at the ids: the softmax term alone (ids may repeat)
        grad.scatter_add_(-1, ids, g_picked)
        grad.scatter_add_(-1, targets[:, None], g_logps[:, None])
        if len(again):
            q = torch.where(torch.isinf(rest)[:, None], 0.0, (others - rest[:, None]).exp())
            grad[again] += g_tail[again, None] * q
        return grad, None, None
