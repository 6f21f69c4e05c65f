"""Which batching mode runs: what `--batching` asks for (or, for auto, the mode the registry's candidates estimate
cheapest), once it reproduces `runtime.logprobs.reference_logps` on a probe of the job's own pairs.

Every mode, asked for or ranked, is checked against reference_logps on real pairs (short ones and the job's longest)
before it runs (runtime/probe.py, at the tolerance of runtime/tolerance.py); the first that agrees is taken (a
requested mode falls back to full_forward, then single; auto to the next cheapest, then single), else the job is
refused. The choice depends only on the data, the model and the
device, so a resumed job picks the same mode again. Reads the registry only: a new mode needs nothing here.
"""

from __future__ import annotations

from functools import partial

from schemas.encoding import EncodedPair

from runtime.errors import JobError
from runtime.probe import disagreement, reference_values

from .registry import REGISTRY, lookup
from .scoring import estimated_cost, score_pairs

FALLBACK = ("full_forward", "single")  # after a mode asked for by name; auto ends with single


def unsupported(mode: str, model, longest: int) -> str | None:
    """Why `mode` cannot run on this model, or None. `longest`: the longest prompt + completion of the job."""
    return lookup(mode).unsupported(model, longest, model.config._attn_implementation)


def candidates(attn: str) -> tuple[str, ...]:
    """The modes auto weighs for an attention implementation, the last registered first: on equal estimates auto
    takes full_forward, then the earliest of this list."""
    return tuple(name for name in reversed(REGISTRY) if REGISTRY[name].in_auto(attn))


def _order(model, requested: str, sample: list[EncodedPair], token_budget: int) -> tuple[list[str], dict]:
    """The modes to try, in order, and (auto) their estimated costs."""
    if requested != "auto":
        return list(dict.fromkeys([requested, *FALLBACK])), {}
    hidden = getattr(model.config.get_text_config(), "hidden_size", 1024)
    cost = {m: estimated_cost(sample, m, token_budget, hidden) for m in candidates(model.config._attn_implementation)}
    return list(dict.fromkeys([*sorted(cost, key=lambda m: (cost[m], m != "full_forward")), FALLBACK[-1]])), cost


def choose_mode(model, requested: str, sample: list[EncodedPair], longest: int, pad_id: int, token_budget: int,
                log, long_pairs: list[EncodedPair] = (), top_k: int = 0, notes: dict | None = None,
                probed: dict | None = None) -> str:
    """The mode to run: `requested`, or for auto the cheapest by estimated_cost. Whatever the mode (full_forward
    and single included), it must first reproduce `reference_logps` on probe pairs (short ones of `sample`, and
    the longest of `sample` and `long_pairs`); one that does not falls back to the next (auto: the next cheapest;
    a requested mode: full_forward, then single), the reason logged once. A model whose numbers depend on batch
    shape runs single. With top_k the mode's top-k ids, log-probs and tail must also reproduce `reference_top_k`.
    Refuses (JobError) if nothing reproduces the reference. `notes` receives the truth's record when a probe
    sequence is too long for the whole forward (runtime/truth.py). `probed` receives the probe's pairs and their
    truth (`pairs`, `truth`), so that a later check of the same pairs (--torch-compile) needs no second reference
    pass over them, and the chosen mode's own values of the probe pairs (`scores`, see score_known): the job's
    pairs among them (its longest) were just scored in that mode and proven, and need no second pass either."""
    attn = model.config._attn_implementation
    if requested != "auto":
        warning = lookup(requested).warning(attn)  # an unknown name is refused here (ValueError)
        if warning:
            log(warning)
    order, cost = _order(model, requested, sample, token_budget)
    probe = probe_pairs(sample, long_pairs=long_pairs)
    truth = reference_values(model, probe, top_k, notes=notes)
    if probed is not None:
        probed.update(pairs=probe, truth=truth)
    if notes and "truth" in notes:
        t = notes["truth"]
        log(f"truth: {t['kind']} for the {t['long_sequences']} probe sequence(s) past {t['whole_elements']:,} logits"
            + (f" (equal to the whole forward within {t['max_relative_difference']:.1e} on the job's sequences that "
               "fit)" if t["kind"] == "chunked" else f" ({t['why']})"))
    rejected = []
    for mode in order:
        got = {}
        reason = unsupported(mode, model, longest) or disagreement(
            model, partial(_kept, got, model, mode, pad_id=pad_id, top_k=top_k), probe, truth=truth)
        if reason is None:
            if probed is not None:  # what this mode gave on the probe, every value within the tolerance of the truth
                values = got["values"]
                probed["scores"] = {"mode": mode, "top_k": top_k,
                                    "pairs": {id(p): (p, values[2 * i], values[2 * i + 1]) for i, p in enumerate(probe)}}
            ratio = (f"; estimated {cost['full_forward'] / cost[mode]:.2f}x less work than full_forward"
                     if mode in cost else "")
            why = f"; instead of {'; '.join(rejected)}" if rejected else ""
            log(f"batching: {mode} ({attn} attention{ratio}; matches the reference forward on a probe{why})")
            return mode
        rejected.append(f"{mode}: {reason}")
    raise JobError(f"no batching mode reproduces this model's own forward ({'; '.join(rejected)}); check the model "
                   "with a plain transformers forward")


def probe_pairs(sample: list[EncodedPair], prompt_cap: int = 24, completion_cap: int = 8,
                long_pairs: list[EncodedPair] = ()) -> list[EncodedPair]:
    """Real pairs: the shortest, and the shortest whose prompt length differs from it, both cut to a few tokens
    (cut to differ still) so the probe also runs a padded batch of prompts and of completions; then, whole, the
    longest pair of `sample` and any `long_pairs` (the job's longest), where length effects show. A long pair of
    the same lengths (prompt, chosen, rejected) as one already taken is left out: it would show the same length
    effects again at the cost of two more reference forwards over the job's longest sequences."""
    def total(p):
        return len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids)

    by_length = sorted(sample, key=total)
    if not by_length:
        return list(long_pairs)
    first = by_length[0]
    other = next((p for p in by_length if len(p.prompt_ids) != len(first.prompt_ids)), None)
    other = other if other is not None else (by_length[1] if len(by_length) > 1 else None)

    def cut(pair: EncodedPair, n: int) -> EncodedPair:  # rejected one token shorter: completions are padded too
        return EncodedPair(pair.prompt_ids[:n], pair.chosen_ids[:completion_cap],
                           pair.rejected_ids[: completion_cap - 1] or pair.rejected_ids[:1])

    probe = [cut(first, prompt_cap)]
    if other is not None:
        n = min(len(other.prompt_ids), prompt_cap)
        if n == len(probe[0].prompt_ids) and n > 1:
            n -= 1
        probe.append(cut(other, n))
    for pair in [by_length[-1], *long_pairs]:
        if all(_shape(pair) != _shape(p) for p in probe):
            probe.append(pair)
    return probe


def _shape(pair: EncodedPair) -> tuple[int, int, int]:
    return len(pair.prompt_ids), len(pair.chosen_ids), len(pair.rejected_ids)


def _kept(kept: dict, model, mode: str, pairs: list[EncodedPair], pad_id: int, top_k: int = 0) -> list:
    """mode_values, the values also put in `kept["values"]` as they came (the job keeps them: score_known)."""
    kept["values"] = mode_values(model, mode, pairs, pad_id, top_k)
    return kept["values"]


def mode_values(model, mode: str, pairs: list[EncodedPair], pad_id: int, top_k: int = 0) -> list:
    """`mode`'s scores for `pairs`, in the probe's order (chosen, rejected of each pair), batched as the mode's
    `probe_budget` allows (all in one batch, or for a padded layout each long pair alone and the short ones
    together)."""
    got_c, got_r, _ = score_pairs(model, pairs, pad_id, lookup(mode).probe_budget(pairs), mode, top_k=top_k)
    return [x for pair in zip(got_c, got_r) for x in pair]


def score_known(model, pairs: list[EncodedPair], pad_id: int, token_budget: int, mode: str, on_batch=None,
                top_k: int = 0, known: dict | None = None):
    """score_pairs, except that a pair the probe already scored in `mode` (`known`: choose_mode's `probed["scores"]`;
    the very same pair object, the job's own, not a cut copy) takes the probe's values instead of a second forward
    over it: they are `mode`'s values of that pair, each within the tolerance of the truth (the probe checked them
    before the mode was taken). The probe runs alike on every rank and every resumed run (the job's first shard and
    longest pair), so a shard holds the same values whoever scores it. The probe's pairs are the job's longest,
    the most costly to score twice. stats: the reused pairs' tokens count as scored (`tokens`), not as processed;
    on_batch is told of them once, after the batches, with reused=True (no batch ran for them)."""
    have = _known_of(pairs, known, mode, top_k)
    if not have:
        return score_pairs(model, pairs, pad_id, token_budget, mode, on_batch, top_k=top_k)
    rest = [i for i in range(len(pairs)) if i not in have]
    chosen, rejected = [None] * len(pairs), [None] * len(pairs)
    stats = {"tokens": 0, "processed": 0, "slots": 0}
    if rest:
        got_c, got_r, stats = score_pairs(model, [pairs[i] for i in rest], pad_id, token_budget, mode, on_batch,
                                          top_k=top_k)
        for i, c, r in zip(rest, got_c, got_r):
            chosen[i], rejected[i] = c, r
    tokens = 0
    for i, (pair, c, r) in have.items():
        chosen[i], rejected[i] = c, r
        tokens += 2 * len(pair.prompt_ids) + len(pair.chosen_ids) + len(pair.rejected_ids)
    if on_batch:
        on_batch(len(have), tokens, reused=True)
    return chosen, rejected, {**stats, "tokens": stats["tokens"] + tokens}


def _known_of(pairs: list[EncodedPair], known: dict | None, mode: str, top_k: int) -> dict:
    """{index in `pairs`: (pair, chosen, rejected)} of the pairs `known` holds for this mode and top-k."""
    if not (known and known.get("mode") == mode and known.get("top_k") == top_k):
        return {}
    return {i: known["pairs"][id(p)] for i, p in enumerate(pairs)
            if id(p) in known["pairs"] and known["pairs"][id(p)][0] is p}


def to_score(pairs: list[EncodedPair], known: dict | None, mode: str, top_k: int) -> list[EncodedPair]:
    """The pairs of `pairs` that score_known runs through the model (those `known` does not hold), in its order."""
    have = _known_of(pairs, known, mode, top_k)
    return [p for i, p in enumerate(pairs) if i not in have]
