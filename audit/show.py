"""audit-ref --show / --html: cached rows token by token, so a user sees which tokens are scored and where the prompt
ends. Each completion token carries its cached reference log-prob and, with a train-dpo run, the policy's log-ratio
(policy minus reference, the policy scored by `runtime.logprobs.reference_logps`, the one sequence log-prob
definition). The token text comes from the tokenizer the cache was made with: its hash is checked against the
cache's tokenizer_hash stamp before anything is shown. `--show` prints to the console (colour on a terminal);
`--html` renders one self-contained page (inline CSS, no scripts, no external resources) whose every data text is
escaped."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from runtime.errors import JobError
from runtime.placement import describe
from runtime.terminal import escaped
from runtime.terminal import style as styled
from schemas import format as fmt
from storage import places
from schemas.findings import labelled
from schemas.rules import stamp_findings
from schemas.stamps import tokenizer_hash

from .checks import PAGE_GENERATOR

# Log-prob bands (lower bound, name): the token's probability >= 1/2, >= 1/10, >= 1/100, below.
BANDS = ((np.log(0.5), "likely"), (np.log(0.1), "plausible"), (np.log(0.01), "unlikely"), (-np.inf, "surprising"))
# a value that is no log-prob at all (NaN, +inf: a damaged cache, which audit-ref fails) is shown as such, marked
INVALID = "invalid"
TERMINAL_COLOURS = {"likely": "green", "plausible": "yellow", "unlikely": "magenta", "surprising": "red",
                    INVALID: "cyan"}
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


# ---------------------------------------------------------------------------------------------------------------
# what is shown: the verified tokenizer, the rows, the policy


def verified_tokenizer(manifest: dict, source: str | None, trust_remote_code: bool = False):
    """The tokenizer of `source` (a folder), else of the model folder the cache recorded, once its hash is the
    cache's tokenizer_hash stamp; a JobError saying what to pass otherwise."""
    from runtime.checkpoint import load_tokenizer

    if source is None:
        model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
        recorded = model.get("path")
        if (not recorded or not Path(recorded).is_dir()) and model.get("hub_id"):  # the hub id, in this HF cache
            from runtime.hub import resolve

            try:
                recorded = resolve(model["hub_id"], "model")
            except JobError:
                pass
        if not recorded or not Path(recorded).is_dir():
            raise JobError(f"the token text needs the tokenizer the cache was made with; its recorded model folder "
                           f"{recorded!r} is not here: pass --model (or --tokenizer) with that checkpoint")
        source = recorded
    tokenizer = load_tokenizer(source, trust_remote_code)
    differ = stamp_findings(manifest["stamps"], {"tokenizer_hash": tokenizer_hash(tokenizer)})
    if differ:
        f = differ[0]
        hashes = "\n".join(labelled(("this tokenizer", "the cache"), f.expected, f.found))
        raise JobError(f"{source}: not the tokenizer the cache was made with (tokenizer_hash), so the token text "
                       f"would be wrong; pass --model (or --tokenizer) with the checkpoint the cache was made with\n"
                       f"{hashes}")
    return tokenizer


def pick_rows(index: pl.DataFrame, wanted: list[str], cache) -> pl.DataFrame:
    """The index rows named by `wanted`: each a row id, else a row index (a value that is not an id may list several,
    comma-separated); an unknown one is a JobError naming it."""
    numbered = index.with_row_index("index")
    by_id = dict(zip(numbered["id"].to_list(), numbered["index"].to_list()))
    picks = []
    for w in [piece.strip() for given in wanted for piece in ([given] if given in by_id else given.split(","))]:
        if w in by_id:
            picks.append(by_id[w])
        elif w.isdigit() and int(w) < index.height:
            picks.append(int(w))
        else:
            some = ", ".join(map(repr, index["id"].head(3).to_list())) + (", …" if index.height > 3 else "")
            how = FIND_IDS.format(some=some, last=index.height - 1) if index.height else "it has no readable rows"
            raise JobError(f"{cache}: no row {w!r} (neither an id nor an index of its {index.height:,} rows); {how}")
    return numbered[picks]


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
    picked; with `policy` (a model) each completion token's log-ratio."""
    from runtime.logprobs import reference_logps

    from .cache import shard_rows

    views = {}
    for (shard,), group in picks.group_by("shard", maintain_order=True):
        index_of = dict(zip(group["row"].to_list(), group["index"].to_list()))
        for r in shard_rows(root / shard, group["row"]):
            r["index"] = index_of[r["row"]]
            parts = {"prompt": Part("prompt", r["prompt_input_ids"], _texts(tokenizer, r["prompt_input_ids"]))}
            for side in fmt.SIDES:
                ids = r[f"{side}_input_ids"]
                top = _top_k(r, side, tokenizer)
                ratio = None
                if policy is not None and top is not None:  # one forward: the log-ratios and the KL
                    ratio, top.kl = _policy_against(policy, r["prompt_input_ids"], ids, r[f"{side}_logps"], top)
                elif policy is not None:
                    policy_logps = reference_logps(policy, r["prompt_input_ids"], ids).cpu().double().numpy()
                    ratio = policy_logps - np.asarray(r[f"{side}_logps"], np.float64)
                parts[side] = Part(side, ids, _texts(tokenizer, ids), np.asarray(r[f"{side}_logps"], np.float64), ratio,
                                   top)
            views[r["index"]] = RowView(r["id"], r["index"], shard, r["row"], **parts,
                                        chosen_logp=float(r["chosen_logp"]), rejected_logp=float(r["rejected_logp"]))
    return [views[i] for i in picks["index"].to_list()]


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


def _policy_against(policy, prompt_ids, ids, ref_logps, top: TopK) -> tuple[np.ndarray, np.ndarray]:
    """The policy's log-ratio at each completion token and its KL(policy || reference) over the reference's K tokens
    and the rest, from the policy's own distribution (runtime.logprobs.reference_log_softmax, the one definition)."""
    import torch

    from runtime.logprobs import reference_log_softmax

    logps = reference_log_softmax(policy, prompt_ids, ids).double().cpu()
    at_tokens = logps.gather(-1, torch.as_tensor(ids)[:, None]).squeeze(-1).numpy()
    top_ids = torch.as_tensor(top.ids)
    p_top = logps.gather(-1, top_ids).numpy()
    p_rest = logps.scatter(-1, top_ids, float("-inf")).logsumexp(-1).numpy()
    return at_tokens - np.asarray(ref_logps, np.float64), coarse_kl(p_top, p_rest, top.logps, top.tail)


def coarse_kl(p_top: np.ndarray, p_rest: np.ndarray, q_top: np.ndarray, q_rest: np.ndarray) -> np.ndarray:
    """Per position KL(p || q) of two distributions coarsened to K outcomes and the rest (log-probs, [T, K] and [T]):
    the sum of p (log p - log q) over the outcomes, an outcome p gives no mass counting 0."""
    lp = np.concatenate([p_top, p_rest[:, None]], 1)
    lq = np.concatenate([q_top, q_rest[:, None]], 1)
    with np.errstate(invalid="ignore"):
        terms = np.where(np.isneginf(lp), 0.0, np.exp(lp) * (lp - lq))
    return terms.sum(-1)


def load_policy(run_dir: str, model_dir: str | None, manifest: dict, trust_remote_code: bool = False):
    """The policy a train-dpo run left in `run_dir` (its checkpoint, or `model_dir` + its LoRA adapter), in the dtype
    the cache was computed in, on this machine's device."""
    from runtime.checkpoint import Checkpoint, preserved_rng, resolve_device, resolve_dtype

    if (Path(run_dir) / "adapter_config.json").is_file():
        if not model_dir:
            raise JobError(f"{run_dir} holds a LoRA adapter: pass --model with its base checkpoint to score the policy")
        checkpoint = Checkpoint.open(model_dir, trust_remote_code, adapter=run_dir)
    else:
        checkpoint = Checkpoint.open(run_dir, trust_remote_code)
    device = resolve_device("auto")
    with preserved_rng():
        return checkpoint.load_model(resolve_dtype((manifest.get("computation") or {}).get("dtype", "float32"),
                                                   device), device)


# ---------------------------------------------------------------------------------------------------------------
# rendering


def band(logp: float) -> str:
    """The log-prob's band (BANDS); INVALID for NaN or a value above 0 (no probability is above 1)."""
    if not logp <= 0:
        return INVALID
    return next(name for bound, name in BANDS if logp >= bound)


def visible(text: str) -> str:
    """A token's text with its whitespace made visible (a newline as ↵, a tab as →, a carriage return as ␍) and
    every other character that is not printable (an escape, a bidi override) escaped (runtime.terminal.escaped):
    what both the console and the page show of data text."""
    return escaped(text.replace("\n", "↵").replace("\t", "→").replace("\r", "␍"))


def quoted(text: str) -> str:
    """A token's visible text between quotes, so leading and trailing spaces show."""
    return f"'{visible(text)}'"


def _signed(x: float) -> str:
    return f"{x:+.3f}"


def render_text(views: list[RowView], colour: bool = True) -> str:
    """The rows for a console: the prompt's tokens between bars, then one line per completion token (position, id,
    text, reference log-prob[, log-ratio]), coloured by log-prob band when `colour`."""
    def style(text, **kw):  # every piece escaped, then coloured (runtime.terminal.style)
        return styled(text, colour, **kw)

    out = []
    legend = ", ".join(style(f"{name} (p >= {np.exp(bound):.2g})" if np.isfinite(bound) else name,
                             fg=TERMINAL_COLOURS[name]) for bound, name in BANDS)
    for v in views:
        out += [style(f"row {v.index} id '{escaped(v.id)}' ({escaped(v.shard)} row {v.row})", bold=True),
                f"  prompt: {len(v.prompt.ids)} tokens, not scored",
                "    |" + "|".join(style(visible(t), dim=True) for t in v.prompt.texts) + "|",
                "  -- the prompt ends here; the completion tokens below are scored --"]
        for part in (v.chosen, v.rejected):
            total = f"reference log-prob {part.ref.sum():.3f}"
            if part.ratio is not None:
                total += f", policy log-ratio {_signed(part.ratio.sum())}"
            out.append(f"  {part.name}: {len(part.ids)} tokens, {total}")
            header = f"    {'pos':>4} {'id':>7}  {'token':<18} {'ref logp':>9}"
            header += f" {'log-ratio':>10}" if part.ratio is not None else ""
            out.append(header + (_top_k_header(part.top) if part.top is not None else ""))
            for j, (i, text, lp) in enumerate(zip(part.ids, part.texts, part.ref)):
                shown = quoted(text)
                line = (f"    {j:>4} {i:>7}  {style(shown.ljust(18), fg=TERMINAL_COLOURS[band(lp)])} "
                        f"{style(f'{lp:>9.3f}', fg=TERMINAL_COLOURS[band(lp)])}")
                if part.ratio is not None:
                    r = part.ratio[j]
                    line += " " + style(f"{_signed(r):>10}", fg="green" if r > 0 else "red" if r < 0 else None)
                out.append(line + (_top_k_cells(part.top, j) if part.top is not None else ""))
        margin = f"  margin: reference chosen - rejected {v.margin:+.3f}"
        if v.policy_margin is not None:
            margin += f"; policy log-ratio chosen - rejected {_signed(v.policy_margin)}"
        out += [margin, "  most of it from: " + _contribution_text(v), ""]
    out.append(f"bands: {legend}")
    return "\n".join(out)


def _top_k_header(top: TopK) -> str:
    k = top.ids.shape[1]
    return (f" {'KL':>7}" if top.kl is not None else "") + f" {f'top-{k} mass':>12}  reference's top {min(k, TOP_ALTERNATIVES)}"


def _shown_kl(value: float) -> float:
    """A KL as the views print it: a rounding below zero (the coarse KL of two normalised distributions is >= 0 up to
    float rounding) prints as 0, never as -0.0000; anything that shows at four decimals is printed as it is."""
    return value if round(value, 4) else 0.0


def _top_k_cells(top: TopK, j: int) -> str:
    """A token's KL (with a policy), the mass of the reference's top K and its most probable tokens."""
    alternatives = ", ".join(f"{visible(text)!r} {p:.3f}" for text, p in top.alternatives(j))
    width = len(f"top-{top.ids.shape[1]} mass")
    return (f" {_shown_kl(top.kl[j]):>7.4f}" if top.kl is not None else "") + f" {top.mass[j]:>{max(width, 12)}.4f}  {alternatives}"


def _alternatives_title(top: TopK, j: int) -> str:
    """The hover text of a top-k cache's token: its KL, the top-k mass and the reference's most probable tokens."""
    kl = f", KL(policy||reference) {_shown_kl(top.kl[j]):.4f}" if top.kl is not None else ""
    alternatives = ", ".join(f"{visible(text)!r} {p:.3f}" for text, p in top.alternatives(j))
    return f"{kl}, top-{top.ids.shape[1]} mass {top.mass[j]:.4f}; reference's most probable: {alternatives}"


def _contributions(v: RowView) -> list[str]:
    return [f"{side} token {j} {quoted(getattr(v, side).texts[j])} {_signed(c)}" for side, j, c in v.contributions()]


def _contribution_text(v: RowView) -> str:
    return ", ".join(_contributions(v))


CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; background: #fff; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 2px 6px; text-align: left; vertical-align: top; }
td.num { text-align: right; font-family: ui-monospace, monospace; }
td code { white-space: nowrap; }
code, .tok { font-family: ui-monospace, monospace; }
.part { margin: 0.4em 0 0.8em; line-height: 2.6em; }
.label { font-weight: bold; margin-right: 0.5em; }
.tok { display: inline-block; white-space: pre; border-radius: 3px; padding: 0 2px; margin: 1px;
       line-height: 1.2em; text-align: center; vertical-align: top; }
.tok small { display: block; font-size: 0.7em; color: #333; }
.prompt .tok { background: #eee; color: #555; }
.end { display: inline-block; border-left: 3px solid #000; height: 2em; margin: 0 6px; vertical-align: middle; }
.invalid { background: #fff; outline: 2px dashed #a10d0d; }
.likely { background: #b7e4b0; } .plausible { background: #fbe7a1; }
.unlikely { background: #f7c08a; } .surprising { background: #f19a9a; }
.tok small.up { color: #05620f; } .tok small.down { color: #a10d0d; }
td.why { font-family: ui-monospace, monospace; white-space: pre; }
"""


def _text(value) -> str:
    """Data text on the page: escaped for HTML, and its non-printing characters shown as the console shows them
    (a bidi override would otherwise reorder what the page displays)."""
    return html.escape(escaped(value))


def _token_html(part: Part, j: int) -> str:
    text = html.escape(visible(part.texts[j]))
    if part.ref is None:
        return f'<span class="tok" title="id {part.ids[j]}">{text}</span>'
    lp = part.ref[j]
    extra = f" log-ratio {_signed(part.ratio[j])}" if part.ratio is not None else ""
    extra += _alternatives_title(part.top, j) if part.top is not None else ""
    ratio = (f'<small class="{"up" if part.ratio[j] >= 0 else "down"}">{_signed(part.ratio[j])}</small>'
             if part.ratio is not None else "")
    kl = (f'<small class="kl">KL {_shown_kl(part.top.kl[j]):.3f}</small>' if part.top is not None and part.top.kl is not None
          else "")
    return (f'<span class="tok {band(lp)}" title="id {part.ids[j]}, log-prob {lp:.4f}{html.escape(extra)}">{text}'
            f"<small>{lp:.2f}</small>{ratio}{kl}</span>")


def _row_html(v: RowView) -> str:
    e = _text
    out = [f'<h2 id="row-{v.index}">row {v.index}: id <code>{e(v.id)}</code> '
           f"<small>({e(v.shard)} row {v.row})</small></h2>",
           f'<div class="part prompt"><span class="label">prompt ({len(v.prompt.ids)} tokens, not scored)</span>'
           + "".join(_token_html(v.prompt, j) for j in range(len(v.prompt.ids)))
           + '<span class="end" title="the prompt ends here"></span></div>']
    for part in (v.chosen, v.rejected):
        total = f"reference {part.ref.sum():.3f}"
        if part.ratio is not None:
            total += f", log-ratio {_signed(part.ratio.sum())}"
        out.append(f'<div class="part {part.name}"><span class="label">{part.name} ({len(part.ids)} tokens, {total})'
                   "</span>" + "".join(_token_html(part, j) for j in range(len(part.ids))) + "</div>")
    return "\n".join(out)


def _summary_html(views: list[RowView]) -> str:
    e = _text
    policy = any(v.policy_margin is not None for v in views)
    head = ["row", "id", "prompt", "chosen", "rejected", "chosen log-prob", "rejected log-prob", "reference margin"]
    head += ["policy log-ratio margin"] if policy else []
    head.append("largest contributions (" + ("policy log-ratios" if policy else "reference log-probs")
                + "; rejected counted negatively)")
    rows = []
    for v in views:
        cells = [f'<td><a href="#row-{v.index}">{v.index}</a></td>', f"<td><code>{e(v.id)}</code></td>"]
        cells += [f'<td class="num">{len(p.ids)}</td>' for p in (v.prompt, v.chosen, v.rejected)]
        cells += [f'<td class="num">{x:.3f}</td>' for x in (v.chosen_logp, v.rejected_logp)]
        cells.append(f'<td class="num">{v.margin:+.3f}</td>')
        if policy:
            cells.append(f'<td class="num">{_signed(v.policy_margin)}</td>')
        cells.append('<td class="why">' + "<br>".join(e(c) for c in _contributions(v)) + "</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return ("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>\n" + "\n".join(rows)
            + "</table>")


def _stamps_html(cache, manifest: dict, notes: list[str]) -> str:
    e = _text
    comp = manifest.get("computation") or {}
    model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    items = [("cache", places.named(cache)), *((k, str(v)) for k, v in (manifest.get("stamps") or {}).items()),
             ("reference", str(model.get("name"))), ("computed", f"{comp.get('dtype')} on {comp.get('device_type')}, "
                                                                  f"{comp.get('mode')} batching"),
             *([("split", describe(comp["layout"]))] if isinstance(comp.get("layout"), dict) else []),
             ("rows", f"{manifest.get('rows')}"), ("made", str(manifest.get("created_at")))]
    table = "<table>" + "".join(f"<tr><th>{e(k)}</th><td><code>{e(v)}</code></td></tr>" for k, v in items) + "</table>"
    return table + "".join(f"<p><strong>{e(note)}</strong></p>" for note in notes)


def run_label(run_dir: str, recorded: dict) -> str:
    """The run whose policy a view scores, as the page names it: its folder, run id, steps and final weights."""
    config = recorded.get("config") if isinstance(recorded.get("config"), dict) else {}
    result = recorded.get("result") if isinstance(recorded.get("result"), dict) else {}
    facts = [f"run id {config['run_id']}" if config.get("run_id") else None,
             f"{result['steps']} step{'' if result.get('steps') == 1 else 's'}" if result.get("steps") is not None
             else None,
             f"final model hash {recorded['final_model_hash']}" if recorded.get("final_model_hash") else None]
    facts = [f for f in facts if f]
    return str(Path(run_dir).resolve()) + (f" ({', '.join(facts)})" if facts else "")


def render_html(views: list[RowView], cache, manifest: dict, notes: list[str] = (), run: str | None = None) -> str:
    """One self-contained page: the cache's stamps (and the run whose log-ratios it shows), a summary of where each
    row's margin comes from, and every row token by token (coloured by log-prob band; hover a token for its id and
    values, and in a top-k cache the reference's most probable tokens)."""
    top_k = any(p.top is not None for v in views for p in (v.chosen, v.rejected))
    legend = " ".join(f'<span class="tok {name}">{name}<small>p &ge; {np.exp(bound):.2g}</small></span>'
                      if np.isfinite(bound) else f'<span class="tok {name}">{name}<small>lower</small></span>'
                      for bound, name in BANDS)
    title = _text(f"refcache audit-ref: {places.location(cache).resolve().name}")
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', PAGE_GENERATOR,
        # nothing is fetched: no network, no scripts, not even images
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">",
        f"<title>{title}</title><style>{CSS}</style></head><body>",
        f"<h1>{title}</h1>", _stamps_html(cache, manifest, list(notes)),
        *([f"<p>Policy: the train-dpo run <code>{html.escape(run)}</code>; its log-ratios are shown.</p>"] if run
          else []),
        f"<p>Reference log-prob bands: {legend}. Grey tokens are the prompt (not scored); the black bar is where it "
        "ends. Under each completion token: its reference log-prob"
        + (" and the policy's log-ratio (policy minus reference)" if any(v.policy_margin is not None for v in views)
           else "")
        + (", and its KL(policy || reference) over the reference's top-k tokens and the rest" if top_k and run
           else "") + "."
        + (" Hover a token for the top-k mass and the reference's most probable tokens with their probabilities."
           if top_k else "") + "</p>",
        f"<h2>Where the margin comes from ({len(views)} rows)</h2>", _summary_html(views),
        *(_row_html(v) for v in views), "</body></html>", ""])
