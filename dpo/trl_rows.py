"""TRL's rows for dpo.trl's DPOTrainer (dpo/trl.py): the token ids of each processed row as TRL's own collator gives
them to the model (its truncation included), refcache's id of each row as precompute-ref names it, and why rows the
cache lacks are missing where its precompute-ref left them out as bad rows."""

from __future__ import annotations

import json
from collections import Counter

from runtime.errors import JobError


def trl_rows(dataset, collator, batch: int = 256) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt_ids, chosen_ids, rejected_ids) of every processed row as TRL's collator gives them to the model
    (truncated, unpadded). TRL's keep_end truncation cuts chosen and rejected apart; a row whose two prompts then
    differ cannot be one cached pair and is refused."""
    out = []
    columns = ["prompt_ids", "chosen_ids", "rejected_ids"]
    for start in range(0, len(dataset), batch):
        chunk = dataset.select_columns(columns)[start:start + batch]
        examples = [dict(zip(columns, values)) for values in zip(*(chunk[c] for c in columns))]
        b = collator(examples)
        ids, attention, completion = (b[k].tolist() for k in ("input_ids", "attention_mask", "completion_mask"))
        n = len(examples)
        for i in range(n):
            sides = []
            for j in (i, n + i):
                seq = [t for t, a in zip(ids[j], attention[j]) if a]
                mask = completion[j][:len(seq)]
                first = mask.index(1) if 1 in mask else len(mask)
                sides.append((seq[:first], seq[first:]))
            (prompt, chosen), (prompt_r, rejected) = sides
            if prompt != prompt_r:
                raise JobError(f"row {start + i} of the dataset: TRL's truncation (truncation_mode keep_end) cut the "
                               "prompt differently before chosen and rejected, and a cache holds one prompt per pair; "
                               "use truncation_mode keep_start, or a max_length that fits the row")
            out.append((prompt, chosen, rejected))
    return out


def _after_final_eos(ids: list[int], eos) -> list[int]:
    """The tokens after the last EOS (what TRL scores of a chat template's text after the completion's end)."""
    if eos is None or eos not in ids:
        return []
    return ids[len(ids) - ids[::-1].index(eos):]


def _row_ids(dataset, columns) -> list[str]:
    """refcache's id of each row, as precompute-ref names it (its `id` column, else a hash of its content)."""
    from runtime.data import _clean
    from schemas.encoding import rename_columns, row_id

    return [row_id(_clean(rename_columns(row, columns))) for row in dataset]


def _skipped_by_the_cache(error, cache, checks: dict):
    """Rows missing because the cache's precompute-ref left them out as bad rows (--on-bad-row skip, listed in its
    skipped.jsonl, e.g. special-token text, which TRL would read as control tokens): say so, and which remedy."""
    from schemas.format import SKIPPED

    try:
        listed = [json.loads(line) for line in (cache.root / SKIPPED).read_text(encoding="utf-8").splitlines()
                  if line.strip()]
    except (OSError, ValueError):
        return error
    cached = set(cache.index.column("id").to_pylist())
    bad = [s for s in listed if isinstance(s, dict) and s.get("id") in checks and s.get("id") not in cached]
    if not bad:
        return error
    reasons = ", ".join(f"{r}: {n}" for r, n in sorted(Counter(s.get("reason") for s in bad).items()))
    return type(error)(error.kind, f"{error.message}; {len(bad)} of them were left out by precompute-ref as bad rows "
                       f"({reasons}; listed in its {SKIPPED}), which TRL would train on as they are",
                       remedy="remove those rows from the dataset (refcache refuses them: e.g. special-token text "
                              "would be read as control tokens), or fix them and re-run precompute-ref",
                       expected=error.expected, found=error.found)
