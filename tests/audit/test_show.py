"""audit-ref --show and --html (audit/show.py): every completion token with its cached reference log-prob, where the
prompt ends, a run's policy log-ratio against an independent forward, the tokenizer checked before anything is shown,
unknown rows and misplaced outputs refused, data text escaped, and the page rendered by a real headless browser
(Debian's chromium; scripts/test.sh installs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch

from support import audit_streams as audit
from conftest import build_llama, edit_manifest, fake_run, precompute_in_process, read_cache, save_checkpoint
from conftest import make_lora_adapter, write_jsonl
from audit.show import quoted, visible
from schemas import format as fmt

CHROMIUM = shutil.which("chromium")
HOSTILE = [{"id": "<b>row-0</b>", "prompt": "<script>document.title='owned'</script> what & why?",
            "chosen": "sure <i>yes</i> & \"quoted\"", "rejected": "hmm </span><img src=x onerror=alert(1)>"},
           {"id": "row-1", "prompt": "why is the sky blue?", "chosen": "sure the sun", "rejected": "hmm red"}]


def texts(tokenizer, ids) -> list[str]:
    return [tokenizer.decode([i]) for i in ids]


def table_lines(out: str, part: str) -> list[list[str]]:
    """The token lines of one part's table in --show's output: [pos, id, 'token', ref logp(, log-ratio)]."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {part}: ")) + 2
    rows = []
    for line in lines[start:]:
        m = re.match(r"^\s+(\d+)\s+(\d+)\s+('.*?'|\".*?\")\s+(-?[\d.]+)(?:\s+([+-][\d.]+))?$", line)
        if not m:
            break
        rows.append([g for g in m.groups() if g is not None])
    return rows


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory, llama_dir):
    from transformers import AutoTokenizer

    out = Path(shutil.copytree(llama_dir, tmp_path_factory.mktemp("tok") / "other"))
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hostile_cache(tmp_path_factory, llama_dir):
    """A cache of rows whose ids and text are HTML."""
    base = tmp_path_factory.mktemp("hostile")
    return precompute_in_process(llama_dir, write_jsonl(base / "rows.jsonl", HOSTILE), base / "cache")


# ---------------------------------------------------------------------------------------------------------------
# --show


def test_show_prints_every_token_with_its_cached_logprob(dpo_cache, tokenizer):
    rows = read_cache(dpo_cache)
    code, out, err = audit(dpo_cache, "--show", "r0003", "--show", "7")
    assert code == 0, err
    assert "\x1b[" not in out  # plain text where the output is not a terminal
    blocks = out.split("\nrow ")
    assert len(blocks) == 2
    for index, block in zip((3, 7), blocks):
        row = rows.row(index, named=True)
        assert f"id {row['id']!r}" in block
        prompt = "    |" + "|".join(visible(t) for t in texts(tokenizer, row["prompt_input_ids"])) + "|"
        lines = block.splitlines()
        assert lines.index(prompt) < lines.index(
            "  -- the prompt ends here; the completion tokens below are scored --") < next(
            i for i, line in enumerate(lines) if line.startswith("  chosen: "))
        for side in fmt.SIDES:
            got = table_lines(block, side)
            ids, logps = row[f"{side}_input_ids"], np.asarray(row[f"{side}_logps"])
            assert [int(g[1]) for g in got] == ids and [int(g[0]) for g in got] == list(range(len(ids)))
            assert [g[2] for g in got] == [quoted(t) for t in texts(tokenizer, ids)]
            np.testing.assert_allclose([float(g[3]) for g in got], logps, atol=5e-4)
        margin = re.search(r"margin: reference chosen - rejected ([+-][\d.]+)", block).group(1)
        assert abs(float(margin) - (row["chosen_logp"] - row["rejected_logp"])) <= 5e-4


def test_show_colours_the_tokens_in_a_terminal(dpo_cache):
    code, out, _ = audit(dpo_cache, "--show", "0", color=True)
    assert code == 0 and "\x1b[" in out


def test_show_unknown_row_is_refused_naming_it_and_how_to_find_ids(dpo_cache):
    code, out, err = audit(dpo_cache, "--show", "r0001,nope")
    assert code == 2 and out == ""
    assert "no row 'nope'" in err and "'r0000'" in err and "index 0..39" in err


def test_show_checks_the_tokenizer_before_showing_anything(dpo_cache, other_tokenizer):
    from transformers import AutoTokenizer

    from schemas.stamps import tokenizer_hash

    code, out, err = audit(dpo_cache, "--show", "0", "--tokenizer", other_tokenizer)
    assert code == 2 and out == ""
    assert "not the tokenizer the cache was made with" in err
    # each hash labelled by its owner: the cache's recorded stamp, and the one of the tokenizer given
    cached = json.loads((dpo_cache / fmt.MANIFEST).read_text())["stamps"]["tokenizer_hash"]
    given = tokenizer_hash(AutoTokenizer.from_pretrained(other_tokenizer))
    assert cached != given
    assert re.search(rf"^\s+the cache:\s+{cached}$", err, re.M), err
    assert re.search(rf"^\s+this tokenizer:\s+{given}$", err, re.M), err


def test_show_without_the_recorded_model_asks_for_model(dpo_cache, tmp_path):
    cache = Path(shutil.copytree(dpo_cache, tmp_path / "cache"))
    edit_manifest(cache, lambda m: m["model"].update(path=str(tmp_path / "gone")))
    code, out, err = audit(cache, "--show", "0")
    assert code == 2 and out == "" and "pass --model" in err


def policy_ratios(policy, row: dict, side: str) -> np.ndarray:
    """The policy's log-probs of a cached completion by hand (one forward, log_softmax, each next token's value)
    minus the cached reference log-probs."""
    ids = row["prompt_input_ids"] + row[f"{side}_input_ids"]
    with torch.no_grad():
        logits = policy(torch.tensor([ids])).logits[0].double()
    start = len(row["prompt_input_ids"])
    own = logits.log_softmax(-1)[start - 1 : -1].gather(-1, torch.tensor(ids[start:])[:, None])[:, 0].numpy()
    return own - np.asarray(row[f"{side}_logps"])


def assert_ratios(out: str, policy, row: dict) -> None:
    """--show's log-ratio column and margin are the policy's, computed by hand."""
    for side in fmt.SIDES:
        ratio = policy_ratios(policy, row, side)
        assert np.abs(ratio).max() > 0.01  # another model than the reference: the ratios say something
        np.testing.assert_allclose([float(g[4]) for g in table_lines(out, side)], ratio, atol=6e-4)
    total = re.search(r"policy log-ratio chosen - rejected ([+-][\d.]+)", out).group(1)
    assert abs(float(total) - (policy_ratios(policy, row, "chosen").sum()
                               - policy_ratios(policy, row, "rejected").sum())) <= 6e-4


def test_show_with_data_says_whether_the_cached_rows_still_match_it(dpo_cache, dpo_data, tmp_path):
    code, out, err = audit(dpo_cache, "--show", "1", "--data", dpo_data)
    assert code == 0 and "row 1 id 'r0001'" in out
    assert f"note: --data {dpo_data}: PASS" in err
    rows = [json.loads(line) for line in dpo_data.read_text().splitlines()]
    rows[1]["chosen"][0]["content"] += " and more"
    code, out, err = audit(dpo_cache, "--show", "1", "--data", write_jsonl(tmp_path / "changed.jsonl", rows))
    assert code == 0 and "row 1 id 'r0001'" in out
    assert "FAIL: the data differs from the cached rows: changed 1: 'r0001'" in err
    assert f"--out {dpo_cache} --update --replace-changed`" in err  # the way to bring the cache to this data


def test_show_with_a_run_gives_the_policys_log_ratio(dpo_cache, llama_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    policy_dir = save_checkpoint(build_llama(len(tokenizer), seed=5), tokenizer, tmp_path / "policy")
    run = fake_run(tmp_path / "run", policy_dir, dpo_cache)
    code, out, err = audit(dpo_cache, "--show", "r0002", "--run", run, "--model", llama_dir)
    assert code == 0, err
    # the terminal view names the run whose log-ratios it shows, as the page does (found by the UX pass)
    assert out.startswith(f"policy: the train-dpo run {run.resolve()}"), out[:300]
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    assert_ratios(out, policy, read_cache(dpo_cache).row(2, named=True))


def test_show_with_a_lora_run_scores_base_plus_adapter(dpo_cache, llama_dir, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    run = fake_run(tmp_path / "run", make_lora_adapter(llama_dir, tmp_path / "adapter"), dpo_cache)
    code, out, err = audit(dpo_cache, "--show", "4", "--run", run)
    assert code == 2 and out == "" and "LoRA adapter" in err and "--model" in err
    code, out, err = audit(dpo_cache, "--show", "4", "--run", run, "--model", llama_dir)
    assert code == 0, err
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    assert_ratios(out, peft.PeftModel.from_pretrained(base, run).eval(), read_cache(dpo_cache).row(4, named=True))


def test_show_refuses_a_run_trained_on_another_cache(dpo_cache, llama_dir, tmp_path):
    run = fake_run(tmp_path / "run", llama_dir, dpo_cache)
    record = json.loads((run / "run-manifest.json").read_text())
    record["reference"]["cache"]["manifest_sha256"] = "0" * 64
    (run / "run-manifest.json").write_text(json.dumps(record))
    code, out, err = audit(dpo_cache, "--show", "0", "--run", run)
    assert code == 2 and out == "" and "--run" in err and "sha256" in err


@pytest.mark.parametrize("view", [("--show", "0"), ("--html", "page.html")])
def test_a_view_of_a_run_whose_weights_are_not_its_final_model_is_refused(dpo_cache, llama_dir, tokenizer, tmp_path,
                                                                          view):
    """Found by the hostile pass: the run folder's model.safetensors replaced by another model's (here the
    reference's) was shown as the run's policy, every log-ratio 0, though audit-ref --run fails run_final_hash. A
    view with --run passes that check first (one check, audit/runs.final_hash_check); nothing is written."""
    policy_dir = save_checkpoint(build_llama(len(tokenizer), seed=5), tokenizer, tmp_path / "policy")
    run = fake_run(tmp_path / "run", policy_dir, dpo_cache)
    shutil.copy(llama_dir / "model.safetensors", run / "model.safetensors")
    args = [a if a != "page.html" else tmp_path / a for a in view]
    code, out, err = audit(dpo_cache, *args, "--run", run, "--model", llama_dir)
    assert code == 2 and out == "" and not (tmp_path / "page.html").exists(), err
    assert f"--run {run}: the checkpoint in {run} hashes to " in err and "not the run's final model" in err, err


# ---------------------------------------------------------------------------------------------------------------
# --html


def test_html_is_one_self_contained_page_of_a_seeded_sample(dpo_cache, tmp_path):
    page_path = tmp_path / "view.html"
    code, out, err = audit(dpo_cache, "--html", page_path, "--sample", 5, "--seed", 1)
    assert code == 0, err
    page = page_path.read_text()
    ids = read_cache(dpo_cache)["id"].to_list()
    picked = np.sort(np.random.default_rng(1).choice(len(ids), size=5, replace=False))
    shown = re.findall(r'<h2 id="row-(\d+)">', page)
    assert [int(i) for i in shown] == picked.tolist()
    manifest = json.loads((dpo_cache / fmt.MANIFEST).read_text())
    assert all(v in page for v in manifest["stamps"].values())
    links = re.findall(r"(?:src|href)\s*=\s*[\"']?([^\"' >]*)", page)
    assert links and all(link.startswith("#") for link in links)  # only the summary's links to its rows
    assert "<script" not in page and "url(" not in page and "@import" not in page
    assert "Where the margin comes from" in page


def test_html_default_sample_and_every_row(dpo_cache, tmp_path):
    for args, rows in ((), 20), (("--all",), 40):
        page_path = tmp_path / "view.html"
        assert audit(dpo_cache, "--html", page_path, *args)[0] == 0
        assert len(re.findall(r'<h2 id="row-', page_path.read_text())) == rows


@pytest.mark.parametrize("where", ["cache", "model"])
def test_html_apart_from_every_input(dpo_cache, llama_dir, tmp_path, where):
    cache = Path(shutil.copytree(dpo_cache, tmp_path / "cache"))
    model = Path(shutil.copytree(llama_dir, tmp_path / "model"))
    target = (cache if where == "cache" else model) / "view.html"
    before = sorted(p.name for p in target.parent.iterdir())
    code, out, err = audit(cache, "--html", target, "--model", model)
    assert code == 2 and "--html" in err and "apart" in err
    assert sorted(p.name for p in target.parent.iterdir()) == before


def test_html_at_a_symlink_is_refused_before_anything_is_shown(dpo_cache, tmp_path, victim):
    link = tmp_path / "view.html"
    link.symlink_to(victim)
    code, out, err = audit(dpo_cache, "--html", link, "--show", "0")
    assert code == 2 and out == "" and "symlink" in err
    assert victim.read_text() == "precious\n" and link.is_symlink()


def test_html_is_a_view_not_the_audit(dpo_cache, tmp_path):
    code, _, err = audit(dpo_cache, "--html", tmp_path / "v.html", "--json", tmp_path / "a.json")
    assert code == 2 and "--json" in err and not (tmp_path / "v.html").exists()


def test_html_escapes_every_data_text(hostile_cache, tokenizer, tmp_path):
    page_path = tmp_path / "view.html"
    assert audit(hostile_cache, "--html", page_path, "--all")[0] == 0
    page = page_path.read_text()
    assert "<script" not in page and "<img" not in page and "<i>" not in page and "<b>row-0" not in page
    assert "&lt;b&gt;row-0&lt;/b&gt;" in page
    # each token is text of its own span: a "<" left unescaped would open a tag and change what the parser reads
    rows = read_cache(hostile_cache).to_dicts()
    assert dom_tokens(page) == [(part, [visible(t) for t in texts(tokenizer, row[f"{part}_input_ids"])])
                                for row in rows for part in ("prompt", *fmt.SIDES)]


class Tokens(HTMLParser):
    """The text of each token span of a page (its numbers removed first), by part (prompt, chosen, rejected)."""

    def __init__(self):
        super().__init__()
        self.parts, self.text = [], None

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "div" and "part" in classes:
            self.parts.append(([c for c in classes if c != "part"][0], []))
        elif tag == "span" and "tok" in classes and self.parts:
            self.text = ""

    def handle_endtag(self, tag):
        if tag == "span" and self.text is not None:
            self.parts[-1][1].append(self.text)
            self.text = None

    def handle_data(self, data):
        if self.text is not None:
            self.text += data


def dom_tokens(dom: str) -> list[tuple[str, list[str]]]:
    """(part, token texts) of each part of the page."""
    stripped = re.sub(r"<small[^>]*>.*?</small>", "", dom, flags=re.S)
    parser = Tokens()
    parser.feed(stripped)
    return parser.parts


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (scripts/test.sh installs it as root)")
def test_html_renders_in_a_headless_browser(hostile_cache, dpo_cache, tokenizer, tmp_path):
    from PIL import Image

    for cache, count in ((hostile_cache, 2), (dpo_cache, 3)):
        page_path = tmp_path / f"{cache.parent.name}.html"
        assert audit(cache, "--html", page_path, "--sample", count)[0] == 0
        url = page_path.resolve().as_uri()
        browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                   f"--user-data-dir={tmp_path / 'profile'}"]
        shot = tmp_path / f"{cache.parent.name}.png"
        subprocess.run([*browser, f"--screenshot={shot}", "--window-size=1000,800", url], check=True,
                       capture_output=True, timeout=120)
        pixels = np.asarray(Image.open(shot).convert("L"), np.float64)
        assert pixels.shape == (800, 1000)
        assert pixels.std() > 20 and (pixels < 200).mean() > 0.02  # text and coloured tokens, not a blank page
        dom = subprocess.run([*browser, "--dump-dom", url], check=True, capture_output=True, text=True,
                             timeout=120).stdout
        assert "<script" not in dom  # the data's <script> stayed text
        rows = read_cache(cache)
        parts = dom_tokens(dom)
        shown = [int(i) for i in re.findall(r'<h2 id="row-(\d+)">', dom)]
        assert len(shown) == count and len(parts) == 3 * count
        for k, index in enumerate(shown):
            row = rows.row(index, named=True)
            for j, part in enumerate(("prompt", *fmt.SIDES)):
                name, tokens = parts[3 * k + j]
                ids = row[f"{part}_input_ids"]
                assert name == part and tokens == [visible(t) for t in texts(tokenizer, ids)]


def test_show_and_html_of_a_row_with_a_nan_logprob(dpo_cache, tmp_path):
    """A damaged value (NaN, or above 0) is shown, marked as no log-prob, and the cache's failing check is named;
    the view does not crash on it (it once raised StopIteration)."""
    from conftest import rewrite_shard
    from audit.show import INVALID, band

    assert band(float("nan")) == band(0.5) == INVALID and band(-0.1) == "likely" and band(float("-inf")) == "surprising"
    cache = Path(shutil.copytree(dpo_cache, tmp_path / "cache"))

    def edit(rows):
        rows[0]["chosen_logps"][1] = float("nan")
        rows[0]["chosen_logp"] = float("nan")

    rewrite_shard(cache, "shard-00000.parquet", edit)
    code, out, err = audit(cache, "--show", "0")
    assert code == 0, err
    assert "this cache fails logprob_values" in err
    assert re.search(r"^\s+1\s+\d+\s+'.*'\s+nan$", out, re.M), out
    code, out, _ = audit(cache, "--show", "0", color=True)
    assert code == 0 and "\x1b[36m" in out  # marked in its own colour
    page = tmp_path / "v.html"
    code, _, err = audit(cache, "--html", page, "--show", "0")
    assert code == 0, err
    assert 'class="tok invalid"' in page.read_text()
# ---------------------------------------------------------------------------------------------------------------
# a top-k cache: the reference's alternatives, the top-k mass, and with --run the per-token KL

K = 4


@pytest.fixture(scope="module")
def top_k_cache(tmp_path_factory, llama_dir, dpo_data):
    return precompute_in_process(llama_dir, dpo_data, tmp_path_factory.mktemp("top-k") / "cache", top_k=K)


def top_k_lines(out: str, part: str) -> list[str]:
    """The token lines of one part's table in --show's output of a top-k cache."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {part}: ")) + 2
    rows = []
    for line in lines[start:]:
        if not re.match(r"^\s+\d+\s+\d+\s", line):
            break
        rows.append(line)
    return rows


def by_hand(model, row: dict, side: str):
    """The model's own distribution at each completion token, by hand: [T, vocabulary] log-probs."""
    ids = row["prompt_input_ids"] + row[f"{side}_input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    start = len(row["prompt_input_ids"])
    return logits.log_softmax(-1)[start - 1 : -1]


def test_show_of_a_top_k_cache_gives_each_tokens_alternatives_and_top_k_mass(top_k_cache, llama_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    code, out, err = audit(top_k_cache, "--show", "3")
    assert code == 0, err
    assert f"top-{K} mass" in out and "reference's top 3" in out
    reference = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    row = read_cache(top_k_cache).row(3, named=True)
    for side in fmt.SIDES:
        logps = by_hand(reference, row, side)
        lines = top_k_lines(out, side)
        assert len(lines) == len(row[f"{side}_input_ids"])
        for j, line in enumerate(lines):
            top = logps[j].topk(3)
            mass = float(logps[j].topk(K).values.exp().sum())
            shown_mass, alternatives = re.search(r"\s([01]\.\d{4})  (.*)$", line).groups()
            assert abs(float(shown_mass) - mass) < 2e-3, (line, mass)
            probabilities = [float(p) for p in re.findall(r" (\d\.\d{3})(?:,|$)", alternatives)]
            np.testing.assert_allclose(probabilities, top.values.exp().numpy(), atol=2e-3)
            # (an untrained model: near ties, which float32 may order either way)
            texts = [repr(visible(tokenizer.decode([i]))) for i in logps[j].topk(K + 2).indices.tolist()]
            assert any(alternatives.startswith(t + " ") for t in texts), (alternatives, texts)


def test_show_of_a_top_k_cache_with_a_run_gives_each_tokens_kl(top_k_cache, llama_dir, tokenizer, tmp_path):
    """The KL column is KL(policy || reference) over the reference's K tokens and the rest, against a hand
    computation from both models' full distributions."""
    from transformers import AutoModelForCausalLM

    policy_dir = save_checkpoint(build_llama(len(tokenizer), seed=5), tokenizer, tmp_path / "policy")
    run = fake_run(tmp_path / "run", policy_dir, top_k_cache)
    code, out, err = audit(top_k_cache, "--show", "2", "--run", run, "--model", llama_dir)
    assert code == 0, err
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    row = read_cache(top_k_cache).row(2, named=True)
    for side in fmt.SIDES:
        p, q = by_hand(policy, row, side), by_hand(reference, row, side)
        top = q.topk(K).indices
        outside = torch.ones_like(p, dtype=torch.bool).scatter(-1, top, False)
        p_rest = torch.where(outside, p.exp(), 0).sum(-1)
        q_rest = torch.where(outside, q.exp(), 0).sum(-1)
        p_top, q_top = p.gather(-1, top).exp(), q.gather(-1, top).exp()
        kl = (p_top * (p_top / q_top).log()).sum(-1) + p_rest * (p_rest / q_rest).log()
        cells = [re.search(r"[+-]?\d+\.\d{3}\s+(\d+(?:\.\d+)?(?:e-\d+)?)\s+[01]\.\d{4}  ", line) for line in
                 top_k_lines(out, side)]
        shown = [float(c.group(1)) for c in cells]
        assert kl.max() > 5e-4  # another model than the reference: the KL says something
        np.testing.assert_allclose(shown, kl.numpy(), atol=1e-4, rtol=0.05)


def test_html_of_a_top_k_cache_with_a_run_names_the_run_and_shows_the_distribution(top_k_cache, llama_dir,
                                                                                    tokenizer, tmp_path):
    policy_dir = save_checkpoint(build_llama(len(tokenizer), seed=5), tokenizer, tmp_path / "policy")
    run = fake_run(tmp_path / "run", policy_dir, top_k_cache)
    page_path = tmp_path / "view.html"
    code, out, err = audit(top_k_cache, "--html", page_path, "--show", "1", "--run", run, "--model", llama_dir)
    assert code == 0, err
    page = page_path.read_text()
    assert f"Policy: the train-dpo run <code>{run.resolve()}" in page
    assert "KL(policy || reference)" in page and '<small class="kl">KL ' in page
    assert f"top-{K} mass" in page and "reference&#x27;s most probable: " in page


def test_show_and_html_without_a_run_construct_no_model(dpo_cache, tmp_path, monkeypatch):
    """Shown from the cache alone (no --run), the token text needs only the tokenizer: no model is built, whatever
    class or loading path (every model's __init__ counted)."""
    import transformers

    built = []
    real = transformers.PreTrainedModel.__init__
    monkeypatch.setattr(transformers.PreTrainedModel, "__init__",
                        lambda self, *a, **k: (built.append(type(self).__name__), real(self, *a, **k))[1])
    code, out, err = audit(dpo_cache, "--show", "r0003")
    assert code == 0, err
    assert "margin: reference chosen - rejected" in out
    code, _, err = audit(dpo_cache, "--html", tmp_path / "page.html", "--sample", 2)
    assert code == 0, err
    assert built == []


def test_small_kl_and_log_ratios_print_as_what_they_are():
    """A run that moved the policy little: a per-token KL of 1e-9 prints as such, not as 0.0000; a rounding below
    zero prints as 0; a log-ratio that rounds to zero has no sign (never -0.000 beside +0.000)."""
    from audit.show import _kl_text, _signed

    assert [_kl_text(x) for x in (3.2e-9, 0.0335, 1e-3, -1e-12, 0.0)] == ["3.2e-09", "0.0335", "0.0010", "0", "0"]
    assert float(_kl_text(3.2e-9)) == 3.2e-9
    assert [_signed(x) for x in (-1e-4, 1e-4, 0.0123, -0.5)] == [" 0.000", " 0.000", "+0.012", "-0.500"]
