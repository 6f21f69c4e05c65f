"""What audit-ref --show / --html show (audit/show.py renders it): the rows picked by id or index, or a seeded sample,
read from their shards with each token's text from the tokenizer the cache was made with (its hash checked against
the cache's tokenizer_hash stamp first), and with a train-dpo run the policy's log-ratio at each completion token
and, in a top-k cache, its KL over the reference's top-k tokens (the policy's values from audit/policy.py: the
definition, `runtime.logprobs.reference_log_softmax`, or batches proven against it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from runtime.errors import JobError
from schemas import format as fmt
from schemas import history
from schemas.findings import labelled
from schemas.rules import stamp_findings
from schemas.stamps import tokenizer_hash


FIND_IDS = ("give a row id (the cache's `id` column: the data's `id` field, or the one precompute-ref gave the row; "
            "here {some}) or a row index 0..{last}; `audit-ref CACHE --html FILE --all` lists every row with its id")
TOP_CONTRIBUTIONS = 3
TOP_ALTERNATIVES = 3  # the reference's alternatives shown per token of a top-k cache


@dataclass
class Part:
    """One part of a row: its token ids and texts; for a completion the cached reference log-probs and, with a
    policy, its log-ratios (both None for the prompt, which is not scored)."""

    name: str
    ids: list[int]
    texts: list[str]
    ref: np.ndarray | None = None
    ratio: np.ndarray | None = None
    top: "TopK | None" = None  # a top-k cache's distribution at each completion token


@dataclass
class TopK:
    """A completion's reference distribution as a top-k cache holds it: per token the K most probable ids ([T, K]),
    their texts and log-probs, the log of the mass outside them (the tail), and with a policy the KL(policy ||
    reference) over those K tokens and the rest (the bound train-dpo logs as kl/policy_ref)."""

    ids: np.ndarray
    texts: list[list[str]]
    logps: np.ndarray
    tail: np.ndarray
    kl: np.ndarray | None = None

    @property
    def mass(self) -> np.ndarray:
        """The probability the K tokens hold at each position (1 - exp(tail))."""
        return -np.expm1(self.tail)

    def alternatives(self, j: int, n: int = TOP_ALTERNATIVES) -> list[tuple[str, float]]:
        """The reference's n most probable tokens at position j: (text, probability)."""
        return [(self.texts[j][i], float(np.exp(self.logps[j][i]))) for i in range(min(n, len(self.texts[j])))]


@dataclass
class RowView:
    id: str
    index: int  # position in the cache (shards in manifest order)
    shard: str
    row: int  # row inside the shard
    prompt: Part
    chosen: Part
    rejected: Part
    chosen_logp: float  # the cached sequence sums
    rejected_logp: float

    @property
    def margin(self) -> float:
        """The reference's margin, chosen minus rejected sequence log-prob."""
        return self.chosen_logp - self.rejected_logp

    @property
    def policy_margin(self) -> float | None:
        """The policy's log-ratio margin (DPO's implicit reward margin over beta), None without a policy."""
        if self.chosen.ratio is None:
            return None
        return float(self.chosen.ratio.sum() - self.rejected.ratio.sum())

    def contributions(self, k: int = TOP_CONTRIBUTIONS) -> list[tuple[str, int, float]]:
        """The k tokens that move the margin most, (side, position, signed contribution): with a policy its
        log-ratios (chosen adds, rejected subtracts), else the reference log-probs the same way."""
        source = "ratio" if self.chosen.ratio is not None else "ref"
        values = [getattr(self.chosen, source), -getattr(self.rejected, source)]
        sides = np.repeat(["chosen", "rejected"], [len(v) for v in values])
        positions = np.concatenate([np.arange(len(v)) for v in values])
        signed = np.concatenate(values)
        order = np.argsort(-np.abs(signed), kind="stable")[:k]
        return [(str(sides[i]), int(positions[i]), float(signed[i])) for i in order]


def verified_tokenizer(manifest: dict, source: str | None, trust_remote_code: bool = False):
    """The tokenizer of `source` (a folder), else of the model folder the cache recorded, once its hash is the
    cache's tokenizer_hash stamp; a JobError saying what to pass otherwise."""
    if source is None:
        model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
        recorded = model.get("path") if isinstance(model.get("path"), str) else None  # text, or nothing recorded
        hub_id = model.get("hub_id") if isinstance(model.get("hub_id"), str) else None
        if (not recorded or not Path(recorded).is_dir()) and hub_id:  # the hub id, in this HF cache
            from runtime.hub import resolve

            try:
                recorded = resolve(hub_id, "model")
            except JobError:
                pass
        if not recorded or not Path(recorded).is_dir():
            raise JobError("the token text needs the tokenizer the cache was made with; its recorded model folder "
                           + (f"{recorded!r} is not here" if recorded else "is not recorded as a path")
                           + ": pass --model (or --tokenizer) with that checkpoint")
        source = recorded
    light = None if trust_remote_code else _backend_only(source)
    if light is not None and not stamp_findings(manifest["stamps"], {"tokenizer_hash": tokenizer_hash(light)}):
        return light
    from runtime.checkpoint import load_tokenizer  # (torch: only where the light path does not do)

    tokenizer = load_tokenizer(source, trust_remote_code)
    differ = stamp_findings(manifest["stamps"], {"tokenizer_hash": tokenizer_hash(tokenizer)})
    if differ:
        f = differ[0]
        hashes = "\n".join(labelled(("this tokenizer", "the cache"), f.expected, f.found))
        raise JobError(f"{source}: not the tokenizer the cache was made with (tokenizer_hash), so the token text "
                       f"would be wrong; pass --model (or --tokenizer) with the checkpoint the cache was made with\n"
                       f"{hashes}")
    return tokenizer


def _backend_only(source: str):
    """The folder's tokenizer.json in transformers' generic tokenizers-backed class, or None (custom code, no
    tokenizer.json, another transformers). AutoTokenizer imports torch (transformers 5), and a view of the cache alone
    needs none: this is taken only where its tokenizer hash (the backend, special tokens and chat template) is the
    cache's stamp, so the token text is the backend's the cache was made with; otherwise the full loader decides."""
    import json

    folder = Path(source)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except (OSError, ValueError, ImportError):
        return None
    if not isinstance(config, dict) or "auto_map" in config or not (folder / "tokenizer.json").is_file():
        return None
    try:
        return TokenizersBackend.from_pretrained(str(folder))
    except Exception:  # anything it cannot load is the full loader's to load or refuse, with its message
        return None


def pick_rows(index: pl.DataFrame, wanted: list[str], cache, root=None, manifest: dict | None = None) -> pl.DataFrame:
    """The index rows named by `wanted`: each a row id, else a row index (a value that is not an id may list several,
    comma-separated); an unknown one is a JobError naming it, the closest ids and (with the cache's `root` and the
    `manifest` shown) the version of the cache that removed it."""
    numbered = index.with_row_index("index")
    by_id = dict(zip(numbered["id"].to_list(), numbered["index"].to_list()))
    picks = []
    for w in [piece.strip() for given in wanted for piece in ([given] if given in by_id else given.split(","))]:
        if w in by_id:
            picks.append(by_id[w])
        elif w.isdigit() and int(w) < index.height:
            picks.append(int(w))
        else:
            raise JobError(f"{cache}: no row {w!r} (neither an id nor an index of its {index.height:,} rows)"
                           + _why_not(w, by_id, index, root, manifest))
    return numbered[picks]


def _why_not(wanted: str, by_id: dict, index: pl.DataFrame, root, manifest: dict | None) -> str:
    """After "no row X": the version of the cache that removed it and the --cache-version that holds it, else the
    closest ids (storage.nearby.closest), else how to find one."""
    from storage.nearby import closest

    if root is not None and manifest is not None:
        removing, holding = history.removed_by(root, manifest, [wanted])
        if removing:
            which = f"version{'s' if len(removing) > 1 else ''} {', '.join(map(str, removing))}"
            return (f"; {which} of the cache removed it (precompute-ref --update, the data no longer had it): "
                    + (f"pass --cache-version {holding} to see it" if holding is not None else
                       "no version kept holds it"))
    near = closest(wanted, by_id)
    if near:
        return f"; did you mean {' or '.join(map(repr, near))}?"
    some = ", ".join(map(repr, index["id"].head(3).to_list())) + (", …" if index.height > 3 else "")
    return "; " + (FIND_IDS.format(some=some, last=index.height - 1) if index.height else "it has no readable rows")


def sample_rows(index: pl.DataFrame, count: int | None, seed: int) -> pl.DataFrame:
    """A seeded sample of `count` rows in cache order (None: every row)."""
    numbered = index.with_row_index("index")
    if count is None or count >= index.height:
        return numbered
    return numbered[np.sort(np.random.default_rng(seed).choice(index.height, size=count, replace=False))]


def _texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text (a byte-level piece of a longer character shows as U+FFFD)."""
    return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def row_views(root: Path, picks: pl.DataFrame, tokenizer, policy=None) -> list[RowView]:
    """The picked rows (from an audit_cache index, with its `index` column) read from their shards, in the order
    picked; with `policy` (an audit.policy.PolicyScorer) each completion token's log-ratio, all rows scored together
    (in batches where they can be)."""
    from .cache import shard_rows

    views = {}
    for (shard,), group in picks.group_by("shard", maintain_order=True):
        index_of = dict(zip(group["row"].to_list(), group["index"].to_list()))
        for r in shard_rows(root / shard, group["row"]):
            views[index_of[r["row"]]] = _view(r, index_of[r["row"]], shard, tokenizer)
    shown = [views[i] for i in picks["index"].to_list()]
    if policy is not None:
        _add_policy(list(views.values()), policy)
    return shown


def _view(r: dict, index: int, shard: str, tokenizer) -> RowView:
    parts = {"prompt": Part("prompt", r["prompt_input_ids"], _texts(tokenizer, r["prompt_input_ids"]))}
    for side in fmt.SIDES:
        ids = r[f"{side}_input_ids"]
        parts[side] = Part(side, ids, _texts(tokenizer, ids), np.asarray(r[f"{side}_logps"], np.float64),
                           top=_top_k(r, side, tokenizer))
    return RowView(r["id"], index, shard, r["row"], **parts, chosen_logp=float(r["chosen_logp"]),
                   rejected_logp=float(r["rejected_logp"]))


def _add_policy(views: list[RowView], policy) -> None:
    """Each completion token's log-ratio, the policy's log-prob minus the cached reference's, and in a top-k cache
    its KL(policy || reference) over the reference's K tokens and the rest, from the policy's own distribution."""
    from schemas.encoding import EncodedPair

    parts = [part for v in views for part in (v.chosen, v.rejected)]
    scores = policy.score([EncodedPair(v.prompt.ids, v.chosen.ids, v.rejected.ids) for v in views],
                          [None if part.top is None else part.top.ids for part in parts])
    for part, s in zip(parts, scores):
        part.ratio = np.asarray(s.logps, np.float64) - part.ref
        if part.top is not None:
            part.top.kl = coarse_kl(np.asarray(s.top_logps, np.float64), np.asarray(s.tail, np.float64),
                                    part.top.logps, part.top.tail)


def _top_k(row: dict, side: str, tokenizer) -> TopK | None:
    """One completion's top-k columns (None for a cache without them), the ids' texts decoded once."""
    if row.get(f"{side}_top_ids") is None:
        return None
    listed = row[f"{side}_top_ids"]
    width = len(listed[0]) if len(listed) else 0
    ids = np.asarray(listed, np.int64).reshape(len(listed), width)
    flat = _texts(tokenizer, ids.ravel().tolist())
    return TopK(ids, [flat[i * width:(i + 1) * width] for i in range(len(ids))],
                np.asarray(row[f"{side}_top_logps"], np.float64).reshape(ids.shape),
                np.asarray(row[f"{side}_tail"], np.float64))


def coarse_kl(p_top: np.ndarray, p_rest: np.ndarray, q_top: np.ndarray, q_rest: np.ndarray) -> np.ndarray:
    """Per position KL(p || q) of two distributions coarsened to K outcomes and the rest (log-probs, [T, K] and [T]):
    the sum of p (log p - log q) over the outcomes, an outcome p gives no mass counting 0."""
    lp = np.concatenate([p_top, p_rest[:, None]], 1)
    lq = np.concatenate([q_top, q_rest[:, None]], 1)
    with np.errstate(invalid="ignore"):
        terms = np.where(np.isneginf(lp), 0.0, np.exp(lp) * (lp - lq))
    return terms.sum(-1)
