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


def _rank(rank: int, init: str, results: str, n: int, seed: int) -> None:
    """One of two gloo ranks: its own half of the pairs, the loss of its slice (tests below)."""
    import json

    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        policy, ref, lengths = _pairs(n)
        mine = _pair_slice(policy, ref, lengths, n, rank)
        state = BetaDPO(LossConfig(beta=0.2, loss_type="beta_dpo", beta_dpo_rho=0.75), seed=seed)
        losses, betas, kept = [], [], []
        for _ in range(3):  # three batches: the moving averages and the generator carry on alike on both ranks
            loss, metrics = dpo_loss(*mine, state.cfg, beta_dpo=state)
            losses.append(float(loss))
            betas.append(float(metrics["beta_dpo/beta"][0]))
            kept.append(metrics["beta_dpo/kept"].bool().tolist())
        with open(f"{results}-{rank}.json", "w") as f:
            json.dump({"loss": losses, "beta": betas, "kept": kept, "mean": state.mean, "std": state.std}, f)
    finally:
        torch.distributed.destroy_process_group()


def _pairs(n):
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 4, (2 * n,), generator=gen)
    policy = -torch.rand(int(lengths.sum()), generator=gen, dtype=torch.float64)
    ref = -torch.rand(int(lengths.sum()), generator=gen, dtype=torch.float64)
    return policy, ref, lengths


def _pair_slice(policy, ref, lengths, n, rank):
    """Rank `rank`'s half of the n pairs, in the [chosen..., rejected...] layout dpo_loss takes."""
    half = n // 2
    starts = torch.cumsum(lengths, 0) - lengths
    seqs = [*range(rank * half, (rank + 1) * half), *range(n + rank * half, n + (rank + 1) * half)]
    take = torch.cat([torch.arange(int(starts[i]), int(starts[i] + lengths[i])) for i in seqs])
    return policy[take], ref[take], lengths[seqs]


def test_under_two_gloo_ranks_the_batch_is_every_ranks_pairs(tmp_path):
    """Each rank's β, moving averages and draw are those of one process over the whole global batch, each rank keeps
    its own slice of that draw, and the mean of the ranks' losses (what DDP's gradient average sees) is the one
    process's loss over every kept pair, also where a rank keeps none of its pairs (rho 0.75: 2 of 8 pairs kept)."""
    import json

    import torch.multiprocessing as mp

    n, seed = 8, 0
    init, results = f"file://{tmp_path / 'rendezvous'}", str(tmp_path / "rank")
    mp.start_processes(_rank, args=(init, results, n, seed), nprocs=2, start_method="spawn", join=True)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]

    policy, ref, lengths = _pairs(n)
    whole = BetaDPO(LossConfig(beta=0.2, loss_type="beta_dpo", beta_dpo_rho=0.75), seed=seed)
    for step in range(3):
        loss, metrics = dpo_loss(policy, ref, lengths, whole.cfg, beta_dpo=whole)
        kept = metrics["beta_dpo/kept"].bool().tolist()
        assert ranks[0]["beta"][step] == ranks[1]["beta"][step] == float(metrics["beta_dpo/beta"][0])
        assert ranks[0]["kept"][step] + ranks[1]["kept"][step] == kept
        assert (ranks[0]["loss"][step] + ranks[1]["loss"][step]) / 2 == pytest.approx(float(loss), abs=1e-12)
    assert any(not any(kept) for kept in ranks[1]["kept"])  # the case a per-rank mean would make 0 / 0
    assert ranks[0]["mean"] == ranks[1]["mean"] == whole.mean and ranks[0]["std"] == ranks[1]["std"] == whole.std
