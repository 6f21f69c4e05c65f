"""Scoring pairs with each prompt computed once, optionally several pairs packed into one row.

A pair is laid out as one segment [prompt | chosen | rejected]. Position ids restart for the rejected completion
at the prompt's length, and an additive 4-D attention mask lets every token see only earlier tokens of its own
pair and branch: prompt tokens see the prompt, chosen tokens the prompt and earlier chosen tokens, rejected tokens
the prompt and earlier rejected tokens. Each token therefore gets exactly the context it has in the plain
[prompt | completion] forward, while the prompt runs through the model once instead of twice. The first rejected
token is scored from the prompt's last position, like the first chosen token.

Packing puts several such segments in one row (segments never see each other), up to the length of the longest
pair, so short pairs fill the room that would otherwise be padding. This needs an attention implementation that honours a custom 4-D mask (sdpa, eager);
modes.choose_mode checks the equality on real pairs and falls back to the plain forward otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from schemas.encoding import EncodedPair

if TYPE_CHECKING:  # torch only where a batch is made: the plans (pack_rows, length_batches) need none
    import torch


def pack_rows(lengths: list[int], pack: bool) -> list[list[int]]:
    """First-fit decreasing: pair indices grouped into rows no longer than the longest pair, so packing removes
    padding without making any row longer (attention cost grows with the square of a row's length).
    pack=False gives one pair per row."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if not pack:
        return [[i] for i in order]
    capacity = max(lengths)
    rows, room = [], []
    for i in order:
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def length_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Indices sorted by length (longest first, ties by index) and cut so batch * longest <= token_budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > token_budget:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def row_batches(rows: list[list[int]], lengths: list[int], token_budget: int) -> list[list[list[int]]]:
    """Rows (longest first) cut into batches of at most token_budget padded tokens."""
    size = [sum(lengths[i] for i in r) for r in rows]
    return [[rows[r] for r in batch] for batch in length_batches(size, token_budget)]


def _layout(pairs: list[EncodedPair], row: list[int]):
    """Token ids, positions, segment, branch (0 prompt, 1 chosen, 2 rejected) and scoring sources of one row."""
    ids, pos, seg, branch, src, tgt = [], [], [], [], [], []
    for k, i in enumerate(row):
        p, c, r = pairs[i].prompt_ids, pairs[i].chosen_ids, pairs[i].rejected_ids
        base, P = len(ids), len(p)
        ids += p + c + r
        pos += list(range(P)) + list(range(P, P + len(c))) + list(range(P, P + len(r)))
        seg += [k] * (P + len(c) + len(r))
        branch += [0] * P + [1] * len(c) + [2] * len(r)
        chosen_at = base + P + np.arange(len(c))
        rejected_at = base + P + len(c) + np.arange(len(r))
        src.append(chosen_at - 1)
        src.append(np.concatenate([[base + P - 1], rejected_at[1:] - 1]))
        tgt.append(chosen_at)
        tgt.append(rejected_at)
    return ids, pos, seg, branch, src, tgt


def tree_inputs(pairs: list[EncodedPair], rows: list[list[int]], pad_id: int, device=None):
    """Token ids, restarted positions, the boolean tree mask [rows, width, width] (True: may attend) and the
    scoring indices (row, source position, target id) for a batch of rows of pairs. Scoring order: row by row,
    pair by pair, chosen tokens then rejected tokens."""
    import torch

    width = max(sum(len(pairs[i].prompt_ids) + len(pairs[i].chosen_ids) + len(pairs[i].rejected_ids) for i in r)
                for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    pos = np.zeros((len(rows), width), dtype=np.int64)
    seg = np.tile(-1 - np.arange(width), (len(rows), 1))  # padding: a segment of its own per token
    branch = np.zeros((len(rows), width), dtype=np.int64)
    src_rows, src_cols, tgt_cols = [], [], []
    for b, row in enumerate(rows):
        i, p, s, br, src, tgt = _layout(pairs, row)
        n = len(i)
        ids[b, :n], pos[b, :n], seg[b, :n], branch[b, :n] = i, p, s, br
        for a, t in zip(src, tgt):
            src_rows.append(np.full(len(a), b))
            src_cols.append(a)
            tgt_cols.append(t)
    seg_t, pos_t, br_t = (torch.as_tensor(x, device=device) for x in (seg, pos, branch))
    allowed = (
        (seg_t[:, :, None] == seg_t[:, None, :])
        & (pos_t[:, None, :] <= pos_t[:, :, None])
        & ((br_t[:, None, :] == 0) | (br_t[:, None, :] == br_t[:, :, None]))
    )
    ids_t = torch.as_tensor(ids, device=device)
    rows_idx = torch.as_tensor(np.concatenate(src_rows), device=device)
    targets = ids_t[rows_idx, torch.as_tensor(np.concatenate(tgt_cols), device=device)]
    return ids_t, pos_t, allowed, rows_idx, torch.as_tensor(np.concatenate(src_cols), device=device), targets


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 4-D additive mask [rows, 1, width, width] the model takes, from a boolean tree mask."""
    import torch

    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def tree_batch(pairs: list[EncodedPair], rows: list[list[int]], pad_id: int, dtype: torch.dtype, device):
    """Model inputs and scoring indices for a batch of rows of pairs."""
    ids, pos, allowed, rows_idx, sources, targets = tree_inputs(pairs, rows, pad_id, device)
    inputs = {"input_ids": ids, "attention_mask": additive_mask(allowed, dtype), "position_ids": pos}
    return inputs, rows_idx, sources, targets
