"""audit-ref --show / --html: cached rows token by token, so a user sees which tokens are scored and where the prompt
ends. Each completion token carries its cached reference log-prob and, with a train-dpo run, the policy's log-ratio
(policy minus reference, the policy scored by `runtime.logprobs.reference_logps`, the one sequence log-prob
definition). The token text comes from the tokenizer the cache was made with: its hash is checked against the
cache's tokenizer_hash stamp before anything is shown. `--show` prints to the console (colour on a terminal);
`--html` renders one self-contained page (inline CSS, no scripts, no external resources) whose every data text is
escaped. What is shown (the rows, their token texts, the policy's values) is gathered by audit/views.py; this module
renders it."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np

from runtime.placement import describe
from runtime.terminal import escaped
from runtime.terminal import style as styled
from storage import places

from .checks import PAGE_GENERATOR
from .views import TOP_ALTERNATIVES, Part, RowView, TopK

# Log-prob bands (lower bound, name): the token's probability >= 1/2, >= 1/10, >= 1/100, below.
BANDS = ((np.log(0.5), "likely"), (np.log(0.1), "plausible"), (np.log(0.01), "unlikely"), (-np.inf, "surprising"))
# a value that is no log-prob at all (NaN, +inf: a damaged cache, which audit-ref fails) is shown as such, marked
INVALID = "invalid"
HTML_ALTERNATIVES = 5  # the reference's most probable tokens in a top-k cache's table per completion (--html)
TERMINAL_COLOURS = {"likely": "green", "plausible": "yellow", "unlikely": "magenta", "surprising": "red",
                    INVALID: "cyan"}


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
                    line += " " + style(f"{_signed(r):>10}", fg="green" if round(r, 3) > 0 else "red" if round(r, 3) < 0 else None)
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


def _kl_text(value: float) -> str:
    """A token's KL as the views print it: four decimals, or two significant digits below 0.001 (a run that moved the
    policy little has per-token KL of 1e-9, which four decimals would show as exactly 0); a rounding below zero (the
    coarse KL of two normalised distributions is >= 0 up to float rounding) prints as 0, never as a negative."""
    if not value > 0:
        return "0"
    four = f"{value:.4f}"  # a display choice, not a tolerance: at least two significant digits shown
    return four if len(four.lstrip("0.")) >= 2 else f"{value:.1e}"


def _signed(x: float) -> str:
    """A log-ratio: three decimals and its sign, 0.000 without one where it rounds to zero (never -0.000 from float
    noise beside +0.000)."""
    return f"{x:+.3f}" if round(x, 3) else " 0.000"


def _top_k_cells(top: TopK, j: int) -> str:
    """A token's KL (with a policy), the mass of the reference's top K and its most probable tokens."""
    alternatives = ", ".join(f"{visible(text)!r} {p:.3f}" for text, p in top.alternatives(j))
    width = len(f"top-{top.ids.shape[1]} mass")
    return (f" {_kl_text(top.kl[j]):>7}" if top.kl is not None else "") + f" {top.mass[j]:>{max(width, 12)}.4f}  {alternatives}"


def _alternatives_title(top: TopK, j: int) -> str:
    """The hover text of a top-k cache's token: its KL, the top-k mass and the reference's most probable tokens."""
    kl = f", KL(policy||reference) {_kl_text(top.kl[j])}" if top.kl is not None else ""
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
details.top-k { margin: -0.4em 0 0.8em; } details.top-k summary { cursor: pointer; color: #335; }
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
    ratio = (f'<small class="{"up" if round(part.ratio[j], 3) >= 0 else "down"}">{_signed(part.ratio[j])}</small>'
             if part.ratio is not None else "")
    kl = (f'<small class="kl">KL {_kl_text(part.top.kl[j])}</small>' if part.top is not None and part.top.kl is not None
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
        if part.top is not None:
            out.append(_top_k_table(part))
    return "\n".join(out)


def _top_k_table(part: Part) -> str:
    """A top-k cache's distribution at each completion token, visible (no hovering): the token, its reference
    log-prob (and the policy's log-ratio and KL with a run), the top-k mass and the reference's most probable tokens
    with their probabilities; one expandable table per completion."""
    top, e = part.top, _text
    shown = min(top.ids.shape[1], HTML_ALTERNATIVES)
    head = ["pos", "token", "ref log-prob", *(["log-ratio"] if part.ratio is not None else []),
            *(["KL(policy || reference)"] if top.kl is not None else []), f"top-{top.ids.shape[1]} mass",
            *(f"reference's #{i + 1}" for i in range(shown))]
    rows = []
    for j in range(len(part.ids)):
        cells = [f'<td class="num">{j}</td>', f"<td><code>{html.escape(quoted(part.texts[j]))}</code></td>",
                 f'<td class="num {band(part.ref[j])}">{part.ref[j]:.4f}</td>']
        if part.ratio is not None:
            cells.append(f'<td class="num">{_signed(part.ratio[j])}</td>')
        if top.kl is not None:
            cells.append(f'<td class="num">{_kl_text(top.kl[j])}</td>')
        cells.append(f'<td class="num">{top.mass[j]:.4f}</td>')
        cells += [f"<td><code>{html.escape(quoted(text))}</code> {p:.3f}</td>" for text, p in top.alternatives(j, shown)]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<details class="top-k {part.name}"><summary>{part.name}: the reference\'s top {shown} at each token, '
            f"with probabilities{' and the KL' if top.kl is not None else ''}</summary><table><tr>"
            + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>\n" + "\n".join(rows) + "</table></details>")


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
        + (" Under each completion, open its table for the reference's most probable tokens at each position with "
           "their probabilities and the top-k mass (also in each token's hover text)." if top_k else "") + "</p>",
        f"<h2>Where the margin comes from ({len(views)} rows)</h2>", _summary_html(views),
        *(_row_html(v) for v in views), "</body></html>", ""])
