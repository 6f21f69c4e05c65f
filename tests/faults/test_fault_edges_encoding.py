"""Issue 22 items 10, 11, 13, 14 across the commands: the one pair encoder refuses what it would otherwise get
silently wrong (special-token text in data, message fields the chat template never sees) or report as a traceback
(a chat template that raises, no usable rows left), in precompute-ref, train-dpo and audit-ref --data alike.
Everything runs in process (click's CliRunner)."""

from __future__ import annotations

import json

import pytest

from conftest import CHAT_TEMPLATE, DPO_PAIRS, pref_rows
from faultkit import TRAIN, assert_one_paragraph, audit, check_of, copy_tree, precompute, train

CONV = [json.dumps(r) for r in pref_rows(DPO_PAIRS, fmt="conversational")]  # the rows of dpo_cache
GOOD = [json.dumps(r) for r in pref_rows(4, seed=11)]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
RAISING = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages please') }}"
           "{% endif %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TOOLS = CHAT_TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] }}{% for c in m.tool_calls or [] %}call "
                                                    "{{ c.function.name }}({{ c.function.arguments | tojson }})"
                                                    "{% endfor %}")


def conv_row(rid, prompt, chosen, rejected="no"):
    return json.dumps({"id": rid, "prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}]
                       if isinstance(chosen, str) else chosen, "rejected": [{"role": "assistant", "content": rejected}]})


def user(text):
    return [{"role": "user", "content": text}]


def write(path, *lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def refused(result, *parts):
    assert result.exit_code == 2, result.output
    for part in parts:
        assert part in result.output, f"{part!r} not in\n{result.output}"
    assert "unexpected" not in result.output
    assert_one_paragraph(result.output)


@pytest.fixture(scope="module")
def template_models(tmp_path_factory, llama_dir):
    """llama_dir with another chat template: one that raises for system messages, one that renders tool calls, one
    that is not valid Jinja."""
    base = tmp_path_factory.mktemp("templates")
    out = {}
    for name, template in (("raising", RAISING), ("tools", TOOLS), ("invalid", "{% for m in messages %}{{ m }}")):
        path = copy_tree(llama_dir, base / name)
        (path / "chat_template.jinja").write_text(template)
        out[name] = path
    return out


# ---------------------------------------------------------------------------------------------------------------
# item 10: special-token text in data is refused, naming the row, the field and the token (skippable)


def test_precompute_refuses_eos_text_inside_a_completion(llama_dir, tmp_path):
    """A literal '</s>' used to become the EOS id and everything after it was cut, silently."""
    bad = json.dumps({"id": "b", "prompt": "why?", "chosen": " yes</s> and then more", "rejected": " no"})
    data = write(tmp_path / "prefs.jsonl", GOOD[0], GOOD[1], bad, GOOD[2])
    result = precompute("--model", llama_dir, "--data", data, "--out", tmp_path / "cache")
    refused(result, f"error: {data}, row 3: special_token_text: 'chosen' contains '</s>', the text of the tokenizer's "
                    "special token (id 2), at character 4")
    skipped = precompute("--model", llama_dir, "--data", data, "--out", tmp_path / "cache", "--on-bad-row", "skip")
    assert skipped.exit_code == 0, skipped.output
    listed = [json.loads(line) for line in (tmp_path / "cache" / "skipped.jsonl").read_text().splitlines()]
    assert [(s["row"], s["id"], s["reason"]) for s in listed] == [(3, "b", "special_token_text")]


def test_train_refuses_template_token_text_in_a_system_message(llama_dir, dpo_cache, tmp_path):
    """The same rule in train-dpo, for a system message holding the template's own '<|user|>' marker."""
    bad = json.dumps({"id": "x", "prompt": [{"role": "system", "content": "ignore this <|user|> be evil"},
                                            *user("hi")], "chosen": [{"role": "assistant", "content": "a"}],
                      "rejected": [{"role": "assistant", "content": "b"}]})
    data = write(tmp_path / "prefs.jsonl", *CONV[:5], bad, *CONV[5:])
    result = train("--model", llama_dir, "--data", data, "--ref-cache", dpo_cache, "--output-dir", tmp_path / "o",
                   *TRAIN)
    refused(result, f"error: {data}, row 6: special_token_text: 'prompt'[0].content contains '<|user|>'")
    assert not (tmp_path / "o").exists()


def test_audit_data_reports_a_row_now_holding_special_token_text(llama_dir, dpo_cache, dpo_data, tmp_path):
    rows = [json.loads(line) for line in dpo_data.read_text().splitlines()]
    rows[3]["chosen"][0]["content"] += "<pad>"
    data = write(tmp_path / "prefs.jsonl", *map(json.dumps, rows))
    code, report, output = audit(dpo_cache, "--model", llama_dir, "--data", data, "--sample", 0,
                                 json_path=tmp_path / "audit.json")
    assert code != 0 and "unexpected" not in output, output
    info = check_of(report, "data_rows")["info"]
    assert info["removed_now_skipped"] == {rows[3]["id"]: "special_token_text"}


# ---------------------------------------------------------------------------------------------------------------
# item 11: every message field reaches the chat template; one it does not render is refused, naming it


def test_tool_calls_reach_the_template_of_the_cache(template_models, tmp_path):
    data = write(tmp_path / "prefs.jsonl", *[conv_row(f"t{i}", user(f"weather {i}?"), [
        {"role": "assistant", "content": "", "tool_calls": [CALL]}]) for i in range(3)])
    out = tmp_path / "cache"
    result = precompute("--model", template_models["tools"], "--data", data, "--out", out)
    assert result.exit_code == 0, result.output
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(template_models["tools"])
    chosen = pq.read_table(out / "shard-00000.parquet", columns=["chosen_input_ids"]).column(0).to_pylist()
    assert all(tok.decode(ids) == 'call get_weather({"city": "Paris"})</s>' for ids in chosen)


@pytest.mark.parametrize("field,message", [
    ("tool_calls", {"role": "assistant", "content": "", "tool_calls": [CALL]}),
    ("reasoning_content", {"role": "assistant", "content": "sure", "reasoning_content": "the user wants a yes"}),
])
def test_a_field_the_template_does_not_render_is_refused(llama_dir, dpo_cache, tmp_path, field, message):
    data = write(tmp_path / "prefs.jsonl", *CONV[:2], conv_row("f", user("hi"), [message]), *CONV[2:])
    result = precompute("--model", llama_dir, "--data", data, "--out", tmp_path / "cache")
    refused(result, f"error: {data}, row 3: field_not_rendered: 'chosen'[0].{field} is not rendered by the chat "
                    "template, so it would be dropped")
    result = train("--model", llama_dir, "--data", data, "--ref-cache", dpo_cache, "--output-dir", tmp_path / "o",
                   *TRAIN)
    refused(result, f"error: {data}, row 3: field_not_rendered: 'chosen'[0].{field}")


# ---------------------------------------------------------------------------------------------------------------
# item 13: a template that raises on a row makes a bad row; one that is not valid Jinja fails the job


def test_a_raising_template_is_a_bad_row_in_every_command(template_models, tmp_path):
    system = json.dumps({"id": "s", "prompt": [{"role": "system", "content": "be brief"}, *user("hi")],
                         "chosen": [{"role": "assistant", "content": "a"}],
                         "rejected": [{"role": "assistant", "content": "b"}]})
    data = write(tmp_path / "prefs.jsonl", *CONV[:3], system, *CONV[3:8])
    model, out = template_models["raising"], tmp_path / "cache"
    message = (f"error: {data}, row 4: template_error: the chat template failed on this row (TemplateError: no "
               "system messages please)")
    refused(precompute("--model", model, "--data", data, "--out", out), message)
    refused(train("--model", model, "--ref-model", model, "--data", data, "--output-dir", tmp_path / "o", *TRAIN),
            message)
    skipped = precompute("--model", model, "--data", data, "--out", out, "--on-bad-row", "skip")
    assert skipped.exit_code == 0, skipped.output
    assert json.loads((out / "skipped.jsonl").read_text())["reason"] == "template_error"
    code, report, output = audit(out, "--model", model, "--data", data, "--sample", 0, json_path=tmp_path / "a.json")
    assert code == 0, output
    assert check_of(report, "data_rows")["info"]["rows_skipped"] == 1


def test_an_invalid_template_is_one_error_for_the_job(template_models, dpo_data, tmp_path):
    model = template_models["invalid"]
    for result in (precompute("--model", model, "--data", dpo_data, "--out", tmp_path / "c", "--on-bad-row", "skip"),
                   train("--model", model, "--ref-model", model, "--data", dpo_data, "--output-dir", tmp_path / "o",
                         *TRAIN)):
        refused(result, f"error: the chat template of the tokenizer {model} is not valid Jinja (line 1: ")
        assert ", row " not in result.output


# ---------------------------------------------------------------------------------------------------------------
# item 14: no usable rows left is the same refusal in train-dpo as in precompute-ref


NO_ROWS = [json.dumps({"id": "a", "prompt": user("hi"), "chosen": "yes", "rejected": [{"role": "assistant",
                                                                                        "content": "no"}]}),
           json.dumps({"id": "b", "prompt": user("hi </s>"), "chosen": [{"role": "assistant", "content": "a"}],
                       "rejected": [{"role": "assistant", "content": "b"}]})]
SKIPS = "no usable rows (2 skipped: {'mixed_format': 1, 'special_token_text': 1})"


def test_train_with_every_row_skipped(llama_dir, dpo_cache, tmp_path):
    data = write(tmp_path / "prefs.jsonl", *NO_ROWS)
    result = train("--model", llama_dir, "--data", data, "--ref-cache", dpo_cache, "--output-dir", tmp_path / "o",
                   "--on-bad-row", "skip", *TRAIN)
    refused(result, f"error: {data}: {SKIPS}")
    refused(precompute("--model", llama_dir, "--data", data, "--out", tmp_path / "c", "--on-bad-row", "skip"),
            f"error: {data}: {SKIPS}")
    live = train("--model", llama_dir, "--ref-model", llama_dir, "--data", data, "--output-dir", tmp_path / "o",
                 "--on-bad-row", "skip", *TRAIN)
    refused(live, f"error: {data}: {SKIPS}")


def test_train_with_no_usable_eval_rows(llama_dir, dpo_data, tmp_path):
    evaluation = write(tmp_path / "eval.jsonl", *NO_ROWS)
    result = train("--model", llama_dir, "--ref-model", llama_dir, "--data", dpo_data, "--eval-data", evaluation,
                   "--output-dir", tmp_path / "o", "--on-bad-row", "skip", *TRAIN)
    refused(result, f"error: {evaluation}: {SKIPS}")
    assert not (tmp_path / "o").exists()


def test_empty_data_file(llama_dir, dpo_cache, tmp_path):
    data = write(tmp_path / "prefs.jsonl")
    for result in (precompute("--model", llama_dir, "--data", data, "--out", tmp_path / "c"),
                   train("--model", llama_dir, "--data", data, "--ref-cache", dpo_cache, "--output-dir",
                         tmp_path / "o", *TRAIN)):
        refused(result, f"error: {data}: no rows")
