"""audit-ref --html of a top-k cache (issue 36 item 4): each completion's distribution is on the page, not only in
hover text: per token the reference's most probable tokens with their probabilities and the top-k mass (checked
against the cache's own columns), with --run the per-token KL, and every token text escaped (HTML in the data)."""

from __future__ import annotations

from html.parser import HTMLParser

import numpy as np
import pytest

from support import audit_streams as audit
from conftest import build_llama, fake_run, manifest_of, precompute_in_process, save_checkpoint, write_jsonl
from audit.show import HTML_ALTERNATIVES, quoted
from schemas import format as fmt

K = 4
ROWS = [{"id": "<b>r0</b>", "prompt": "<script>x</script> why & how?", "chosen": "sure <i>yes</i> & \"so\"",
         "rejected": "hmm </td><img src=x>"},
        {"id": "r1", "prompt": "why is the sky blue?", "chosen": "sure the sun", "rejected": "hmm red"}]


@pytest.fixture(scope="module")
def cache(tmp_path_factory, llama_dir):
    base = tmp_path_factory.mktemp("top-k-html")
    return precompute_in_process(llama_dir, write_jsonl(base / "rows.jsonl", ROWS), base / "cache", top_k=K)


class Tables(HTMLParser):
    """Each top-k table of a page: (its part, header cells, rows of cell texts)."""

    def __init__(self):
        super().__init__()
        self.tables, self.cell, self.inside = [], None, False

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "details" and "top-k" in classes:
            self.inside = True
            self.tables.append(([c for c in classes if c != "top-k"][0], [], []))
        elif self.inside and tag == "tr":
            self.tables[-1][2].append([])
        elif self.inside and tag in ("td", "th"):
            self.cell = ""

    def handle_endtag(self, tag):
        if tag == "details":
            self.inside = False
        elif self.inside and tag in ("td", "th") and self.cell is not None:
            self.tables[-1][2][-1].append(self.cell)
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data


def tables(page: str) -> list[tuple[str, list[str], list[list[str]]]]:
    parser = Tables()
    parser.feed(page)
    return [(part, rows[0], rows[1:]) for part, _, rows in parser.tables]


def decoded(cache) -> list[dict]:
    """Every row as the format reads it (schemas.format.read_columns: the top-k columns decoded to [T, K])."""
    import polars as pl

    return pl.concat([pl.from_arrow(fmt.read_columns(cache / s["file"]).replace_schema_metadata(None))
                      for s in manifest_of(cache)["shards"]]).to_dicts()


def test_the_page_shows_each_tokens_alternatives_and_top_k_mass_as_the_cache_holds_them(cache, tokenizer, tmp_path):
    page_path = tmp_path / "view.html"
    code, _, err = audit(cache, "--html", page_path, "--all")
    assert code == 0, err
    page = page_path.read_text()
    assert "<script" not in page and "<img" not in page and "<i>" not in page
    shown = min(K, HTML_ALTERNATIVES)
    found = tables(page)
    assert [part for part, _, _ in found] == [side for _ in ROWS for side in fmt.SIDES]
    for (side, head, rows), (row, side_again) in zip(found, [(r, s) for r in decoded(cache) for s in fmt.SIDES]):
        assert side == side_again
        assert head == ["pos", "token", "ref log-prob", f"top-{K} mass", *(f"reference's #{i + 1}" for i in
                                                                          range(shown))]
        ids = row[f"{side}_input_ids"]
        assert len(rows) == len(ids)
        for j, cells in enumerate(rows):
            assert cells[:3] == [str(j), quoted(tokenizer.decode([ids[j]])), f"{row[f'{side}_logps'][j]:.4f}"]
            assert cells[3] == f"{-np.expm1(row[f'{side}_tail'][j]):.4f}"
            top_ids, top_logps = row[f"{side}_top_ids"][j], row[f"{side}_top_logps"][j]
            assert cells[4:] == [f"{quoted(tokenizer.decode([i]))} {np.exp(lp):.3f}"
                                 for i, lp in zip(top_ids[:shown], top_logps[:shown])]


def test_with_a_run_the_table_gives_each_tokens_kl(cache, llama_dir, tokenizer, tmp_path):
    policy = save_checkpoint(build_llama(len(tokenizer), seed=5), tokenizer, tmp_path / "policy")
    run = fake_run(tmp_path / "run", policy, cache)
    page_path = tmp_path / "view.html"
    code, _, err = audit(cache, "--html", page_path, "--show", "r1", "--run", run, "--model", llama_dir)
    assert code == 0, err
    for _, head, rows in tables(page_path.read_text()):
        assert head[3:6] == ["log-ratio", "KL(policy || reference)", f"top-{K} mass"]
        kl = [float(cells[4]) for cells in rows]
        assert min(kl) >= 0 and max(kl) > 0  # another model than the reference: the KL says something
