"""runtime/cost.py, the one cost model of a batch layout: its figures by hand, and precompute-ref's modes and
train-dpo's layouts weighed by it alike (padded rows of sequences = full_forward, packed pairs under the tree mask =
packed), so auto decides on the same notion of work in both jobs."""

from __future__ import annotations

import numpy as np
import pytest

from runtime import cost
from schemas.encoding import EncodedPair


def test_the_figures_by_hand():
    h = 10  # a score weighs 1 / 60 of a token
    assert cost.work(*cost.padded_rows(np.array([7, 6, 7, 6])), h) == 4 * 7 + 4 * 49 / 60
    assert cost.work(*cost.padded_rows(np.array([6, 6])), h) == 2 * 6 + 2 * 36 / 2 / 60  # no padding: causal half
    assert cost.work(*cost.unpadded_sequences(np.array([7, 6])), h) == 13 + (49 + 36) / 2 / 60
    assert cost.work(*cost.tree_rows([9, 5]), h) == 2 * 9 + 2 * 81 / 60  # a custom mask: every score


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_train_dpo_layouts_and_precompute_modes_weigh_the_same_batch_alike(seed):
    from dpo.layout import estimated_work
    from precompute import modes

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, size=(12, 3))
    pairs = [EncodedPair([1] * int(p), [2] * int(c), [3] * int(r)) for p, c, r in lengths]
    work = estimated_work(lengths, batch_size=len(pairs), hidden=64)  # one batch: every pair
    assert work["padded"] == pytest.approx(modes.estimated_cost(pairs, "full_forward", 10**9, 64), rel=1e-12)
    assert work["prefix_shared"] == pytest.approx(modes.estimated_cost(pairs, "packed", 10**9, 64), rel=1e-12)
