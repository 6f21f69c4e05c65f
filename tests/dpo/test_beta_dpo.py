"""β-DPO (Wu et al. 2024; dpo/losses.py BetaDPO) against an independent float64 implementation of the paper's
equations on fixed inputs: the moving mean and deviation of the reward discrepancy, the batch's β, the size and
typicality of the filtered set, and the loss over it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpo.losses import BetaDPO, LossConfig, dpo_loss

GAPS = [0.3, -0.2, 0.5, 0.1, 0.0, 0.25, -0.1, 0.4, 0.15, 60.0]  # the last pair far from the others: an outlier


def paper(gaps, mean, std, beta0, alpha, rho, m, kept):
    """The paper's equations in float64 (numpy), for the pairs `kept` that the draw chose."""
    g = np.asarray(gaps, np.float64)
    mean = m * mean + (1 - m) * g.mean()
    std = m * std + (1 - m) * g.std(ddof=1)
    weights = np.exp(-((g - mean) ** 2) / (2 * std**2))
    beta = max(beta0 * (1 + alpha * (g[kept].mean() - mean)), 1e-3)
    return mean, std, weights, beta, int(math.floor(len(g) * (1 - rho)))


def test_the_batch_beta_and_moving_averages_are_the_papers_and_the_outlier_is_filtered_out():
    cfg = LossConfig(beta=0.1, loss_type="beta_dpo", beta_dpo_alpha=0.6, beta_dpo_rho=0.2, beta_dpo_momentum=0.9)
    state = BetaDPO(cfg, seed=5)
    state.mean, state.std = 0.05, 2.0  # as after earlier batches
    beta, kept = state.batch(torch.tensor(GAPS, dtype=torch.float32))
    kept = kept.numpy()
    mean, std, weights, want, size = paper(np.float32(GAPS), 0.05, 2.0, 0.1, 0.6, 0.2, 0.9, kept)
    assert kept.sum() == size == 8
    assert not kept[-1] and weights[-1] < 1e-30  # the outlier's weight is nil: never drawn
    assert abs(state.mean - mean) <= 1e-6 and abs(state.std - std) <= 1e-6
    assert abs(beta - want) <= 1e-6
    # a second batch continues from the moved averages
    beta2, kept2 = state.batch(torch.tensor(GAPS[:5], dtype=torch.float32))
    mean2, std2, _, want2, size2 = paper(np.float32(GAPS[:5]), mean, std, 0.1, 0.6, 0.2, 0.9, kept2.numpy())
    assert kept2.sum() == size2 == 4 and abs(beta2 - want2) <= 1e-6 and abs(state.mean - mean2) <= 1e-6


def test_the_draw_follows_the_weights():
    """Over many draws of 1 pair of 3, each pair's frequency is its weight's share (the multinomial of the paper)."""
    cfg = LossConfig(loss_type="beta_dpo", beta_dpo_rho=0.5, beta_dpo_momentum=0.0)
    gaps = torch.tensor([0.0, 1.0, 2.0])
    counts = np.zeros(3)
    state = BetaDPO(cfg, seed=0)
    for _ in range(3000):
        state.mean, state.std = 0.0, 0.0
        _, kept = state.batch(gaps)
        counts += kept.numpy()
    mean, std = 1.0, 1.0  # momentum 0: the batch's own mean and sample deviation
    w = np.exp(-((np.array([0.0, 1.0, 2.0]) - mean) ** 2) / (2 * std**2))
    assert counts.sum() == 3000
    assert np.abs(counts / 3000 - w / w.sum()).max() < 0.03


def test_the_loss_is_the_mean_over_the_kept_pairs_at_the_batchs_beta():
    gen = torch.Generator().manual_seed(1)
    n, lengths = 6, torch.tensor([2, 3, 1, 2, 2, 1, 3, 1, 2, 2, 1, 1])
    policy = -torch.rand(int(lengths.sum()), generator=gen, dtype=torch.float64)
    ref = -torch.rand(int(lengths.sum()), generator=gen, dtype=torch.float64)
    cfg = LossConfig(beta=0.2, loss_type="beta_dpo")
    state = BetaDPO(cfg, seed=2)
    loss, metrics = dpo_loss(policy, ref, lengths, cfg, beta_dpo=state)
    seq = torch.repeat_interleave(torch.arange(2 * n), lengths)
    s = torch.zeros(2 * n, dtype=torch.float64).index_add(0, seq, policy - ref).numpy()
    d = s[:n] - s[n:]
    kept = metrics["beta_dpo/kept"].numpy().astype(bool)
    _, _, _, beta, size = paper(d, 0.0, 0.0, 0.2, 0.6, 0.2, 0.9, kept)
    assert kept.sum() == size and float(metrics["beta_dpo/beta"][0]) == pytest.approx(beta, abs=1e-6)
    want = np.mean([math.log1p(math.exp(-beta * x)) for x in d[kept]])
    assert float(loss) == pytest.approx(want, abs=1e-6)
    # without the state (eval) it is sigmoid DPO at beta_0 over every pair
    plain, _ = dpo_loss(policy, ref, lengths, cfg)
    assert float(plain) == pytest.approx(np.mean([math.log1p(math.exp(-0.2 * x)) for x in d]), abs=1e-9)
