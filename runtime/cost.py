"""The work of a batch layout, in token equivalents: the one cost model behind precompute-ref's `--batching auto`
(precompute/modes) and train-dpo's `--batch-layout auto` (dpo/layout.py).

Work = every slot that runs through the layers (padding included) + the attention scores the kernel computes, each
weighted 1 / (6 * hidden) of a token: a layer's linear maps cost about 24 h^2 FLOPs per token, attention about 4 h
per score. Masked scores count: a custom or padding mask makes the kernel compute them anyway; causal attention
without padding lets the kernel skip the upper triangle (transformers then passes no mask), as flash attention does
per sequence (varlen). A layout's cost per batch is (slots, scores).
"""

from __future__ import annotations

import numpy as np


def work(slots: float, scores: float, hidden: int) -> float:
    """Token equivalents of `slots` through the layers and `scores` attention scores, for a model of width `hidden`."""
    return float(slots + scores / (6 * hidden))


def causal(lengths: np.ndarray) -> float:
    """Share of a padded batch's score matrix computed: without padding the kernel skips the upper triangle."""
    return 0.5 if (lengths == lengths[0]).all() else 1.0


def padded_rows(lengths: np.ndarray) -> tuple[float, float]:
    """(slots, scores) of sequences of `lengths` as right-padded rows of the longest (causal mask)."""
    return len(lengths) * lengths.max(), len(lengths) * lengths.max() ** 2 * causal(lengths)


def unpadded_sequences(lengths: np.ndarray) -> tuple[float, float]:
    """(slots, scores) of sequences of `lengths` run without padding (one by one, or varlen): each its own triangle."""
    return lengths.sum(), (lengths**2).sum() / 2


def tree_rows(widths: list[int]) -> tuple[float, float]:
    """(slots, scores) of rows of segments under a custom (tree) mask, padded to the widest: every score computed."""
    width = max(widths)
    return len(widths) * width, len(widths) * width**2
