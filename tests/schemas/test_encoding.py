"""The pair encoder (schemas/encoding.py): formats, chat template, special tokens, truncation, bad rows, checksums."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import struct

import pytest

from conftest import gpt2_style, llama_style, pref_rows
from schemas.encoding import (
    BadRowError,
    EncodedPair,
    EncodingConfig,
    RecordedEncodingError,
    encode_pair,
    parse_row,
    row_id,
    row_mask_checksum,
)

# The tests below were written for the BOS rule of caches made before the "tokenizer" rule (always prepend BOS): they
# keep that encoding, which old caches still verify with, pinned. The "tokenizer" rule: the last section.
CFG = EncodingConfig(add_bos=True)
USER = lambda s: {"role": "user", "content": s}
ASSISTANT = lambda s: {"role": "assistant", "content": s}


@pytest.fixture(scope="session")
def ids(tokenizer):
    """Plain tokenization, no special tokens added: the reference every expectation is built from."""
    return lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="session")
def bos_eos(tokenizer):
    assert tokenizer.bos_token_id is not None and tokenizer.eos_token_id is not None
    return tokenizer.bos_token_id, tokenizer.eos_token_id


@pytest.fixture(scope="session")
def untemplated(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    return tok


def reason(row, tokenizer, config=CFG) -> str:
    with pytest.raises(BadRowError) as err:
        encode_pair(row, tokenizer, config)
    assert err.value.reason in str(err.value)  # the message leads with its key
    assert isinstance(err.value, ValueError)
    return err.value.reason


# ---------------------------------------------------------------------------------------------------------------
# the three TRL formats


def test_standard_strings(tokenizer, ids, bos_eos):
    bos, eos = bos_eos
    row = {"prompt": "what colour is the sky?", "chosen": " blue", "rejected": " green"}
    enc = encode_pair(row, tokenizer, CFG)
    assert isinstance(enc, EncodedPair)
    assert enc.prompt_ids == [bos] + ids("what colour is the sky?")
    assert enc.chosen_ids == ids(" blue") + [eos]
    assert enc.rejected_ids == ids(" green") + [eos]
    assert tokenizer.decode(enc.chosen_ids) == " blue</s>"


def test_conversational_messages(tokenizer, ids, bos_eos):
    bos, eos = bos_eos
    prompt = [{"role": "system", "content": "be brief"}, USER("what colour is the sky?")]
    row = {"prompt": prompt, "chosen": [ASSISTANT("blue")], "rejected": [ASSISTANT("green")]}
    enc = encode_pair(row, tokenizer, CFG)
    rendered = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|assistant|>\n")
    assert enc.prompt_ids == [bos] + ids(rendered)
    # The template writes "blue</s>\n"; the completion is scored through its final EOS and the "\n" is dropped.
    assert enc.chosen_ids == ids("blue") + [eos]
    assert enc.rejected_ids == ids("green") + [eos]
    assert tokenizer.decode(enc.chosen_ids) == "blue</s>"


def test_template_text_after_final_eos_is_not_kept(tokenizer, ids, bos_eos):
    _, eos = bos_eos
    newline = ids("\n")
    row = pref_rows(1, fmt="conversational")[0]
    for add_eos in (True, False):
        enc = encode_pair(row, tokenizer, dataclasses.replace(CFG, add_eos=add_eos))
        for comp in (enc.chosen_ids, enc.rejected_ids):
            assert comp[-1] == eos and comp.count(eos) == 1
            assert comp[-1 - len(newline) : -1] != newline or len(comp) <= len(newline)
        full = ids(tokenizer.apply_chat_template(row["prompt"] + row["chosen"], tokenize=False))
        assert full[-len(newline) :] == newline  # the template really does write text after the EOS
        assert full[len(enc.prompt_ids) - 1 :] == enc.chosen_ids + newline  # (-1: BOS is not in the template)


def test_implicit_prompt_strings(tokenizer):
    row = {"id": "x", "chosen": "what colour is the sky? blue it is", "rejected": "what colour is the sky? green"}
    prompt, chosen, rejected, conversational = parse_row(row)
    assert (prompt, chosen, rejected, conversational) == ("what colour is the sky?", " blue it is", " green", False)
    explicit = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    assert encode_pair(row, tokenizer, CFG) == encode_pair(explicit, tokenizer, CFG)


def test_implicit_prompt_backs_up_to_a_word_boundary(tokenizer):
    # The common prefix "the sky is b" ends inside a word; the prompt is cut back to the last whitespace.
    prompt, chosen, rejected, _ = parse_row({"chosen": "the sky is blue", "rejected": "the sky is black"})
    assert (prompt, chosen, rejected) == ("the sky is", " blue", " black")


def test_implicit_prompt_message_lists(tokenizer):
    q, a1 = USER("one plus two?"), ASSISTANT("three")
    row = {"chosen": [q, a1, USER("and plus one?"), ASSISTANT("four")],
           "rejected": [q, a1, USER("and plus one?"), ASSISTANT("five")]}
    prompt, chosen, rejected, conversational = parse_row(row)
    assert conversational and prompt == row["chosen"][:3]
    assert chosen == [ASSISTANT("four")] and rejected == [ASSISTANT("five")]
    explicit = {"prompt": row["chosen"][:3], "chosen": [ASSISTANT("four")], "rejected": [ASSISTANT("five")]}
    assert encode_pair(row, tokenizer, CFG) == encode_pair(explicit, tokenizer, CFG)


def test_fixture_formats_agree(tokenizer):
    """Standard and implicit-prompt rows with the same content encode alike (implicit completions keep the space)."""
    for std, imp in zip(pref_rows(8, fmt="standard"), pref_rows(8, fmt="implicit")):
        a = encode_pair(std, tokenizer, CFG)
        b = encode_pair(imp, tokenizer, CFG)
        assert a.prompt_ids == b.prompt_ids
        assert b.chosen_ids == encode_pair({**std, "chosen": " " + std["chosen"]}, tokenizer, CFG).chosen_ids


# ---------------------------------------------------------------------------------------------------------------
# chat template modes, BOS and EOS


def test_chat_template_auto_on_off(tokenizer, ids, bos_eos, untemplated):
    bos, eos = bos_eos
    user_id = tokenizer.convert_tokens_to_ids("<|user|>")
    std = {"prompt": "why is the sky blue?", "chosen": "sun", "rejected": "moon"}
    conv = {"prompt": [USER(std["prompt"])], "chosen": [ASSISTANT("sun")], "rejected": [ASSISTANT("moon")]}
    auto, on, off = (dataclasses.replace(CFG, chat_template=m) for m in ("auto", "on", "off"))

    # auto: strings stay plain, message lists are templated
    assert encode_pair(std, tokenizer, auto).prompt_ids == [bos] + ids(std["prompt"])
    templated = encode_pair(conv, tokenizer, auto)
    assert user_id in templated.prompt_ids
    # on: plain strings are wrapped as one user turn and one assistant turn
    assert encode_pair(std, tokenizer, on) == templated
    assert encode_pair(conv, tokenizer, on) == templated
    # off: strings plain; message lists cannot be encoded
    assert encode_pair(std, tokenizer, off) == encode_pair(std, tokenizer, auto)
    assert reason(conv, tokenizer, off) == "needs_chat_template"
    # a tokenizer without a template cannot encode conversational rows, nor strings with chat_template=on
    assert reason(conv, untemplated, auto) == "needs_chat_template"
    assert reason(std, untemplated, on) == "needs_chat_template"
    assert encode_pair(std, untemplated, auto) == encode_pair(std, tokenizer, auto)


def test_template_that_is_not_a_prefix_is_refused(tokenizer):
    tok = copy.deepcopy(tokenizer)
    # Renders the prompt with a marker that disappears once the assistant turn is appended.
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\nsure: {% endif %}"
    )
    row = pref_rows(1, fmt="conversational")[0]
    assert reason(row, tok) == "template_not_prefix"


def test_add_bos(tokenizer, ids, bos_eos):
    bos, _ = bos_eos
    row = {"prompt": "hmm why?", "chosen": "yes", "rejected": "no"}
    assert encode_pair(row, tokenizer, CFG).prompt_ids == [bos] + ids("hmm why?")
    assert encode_pair(row, tokenizer, dataclasses.replace(CFG, add_bos=False)).prompt_ids == ids("hmm why?")
    # BOS text at the start of a prompt is data text, refused like any special token's text (issue 22 item 10).
    with_bos = {**row, "prompt": "<s>hmm why?"}
    assert reason(with_bos, tokenizer) == "special_token_text"
    # The templated prompt gets BOS too (the template does not write one).
    conv = pref_rows(1, fmt="conversational")[0]
    assert encode_pair(conv, tokenizer, CFG).prompt_ids[:2] == [bos, tokenizer.convert_tokens_to_ids("<|user|>")]


def test_add_eos(tokenizer, ids, bos_eos):
    _, eos = bos_eos
    row = {"prompt": "hmm why?", "chosen": " yes", "rejected": " no"}
    assert encode_pair(row, tokenizer, CFG).chosen_ids == ids(" yes") + [eos]
    no_eos = encode_pair(row, tokenizer, dataclasses.replace(CFG, add_eos=False))
    assert (no_eos.chosen_ids, no_eos.rejected_ids) == (ids(" yes"), ids(" no"))
    # EOS text in a completion is data text, never the control token: refused, at the end (where it would have
    # been read as the EOS the encoder adds) as in the middle (where the text after it was cut; issue 22 item 10).
    for chosen in (" yes</s>", " yes</s> sure"):
        assert reason({**row, "chosen": chosen}, tokenizer) == "special_token_text"


# ---------------------------------------------------------------------------------------------------------------
# truncation


LONG = {"prompt": "one two three four five six seven?", "chosen": " the cat and the dog run and swim and fly",
        "rejected": " no"}


def test_fits_untouched(tokenizer):
    full = encode_pair(LONG, tokenizer, CFG)
    exact = len(full.prompt_ids) + len(full.chosen_ids)
    for mode in ("keep_start", "keep_end", "error"):
        assert encode_pair(LONG, tokenizer, EncodingConfig(max_length=exact, truncation_mode=mode, add_bos=True)) == full


def test_keep_start_cuts_the_completion_end(tokenizer):
    full = encode_pair(LONG, tokenizer, CFG)
    limit = len(full.prompt_ids) + 4
    cut = encode_pair(LONG, tokenizer, EncodingConfig(max_length=limit, truncation_mode="keep_start", add_bos=True))
    assert cut.prompt_ids == full.prompt_ids  # prompt intact
    assert cut.chosen_ids == full.chosen_ids[:4] and len(full.chosen_ids) > 4
    assert cut.chosen_ids[-1] != tokenizer.eos_token_id  # the cut completion has lost its EOS
    assert cut.rejected_ids == full.rejected_ids  # short enough to stay whole


def test_keep_end_cuts_the_prompt_start_and_keeps_bos(tokenizer, bos_eos):
    bos, _ = bos_eos
    full = encode_pair(LONG, tokenizer, CFG)
    longest = len(full.chosen_ids)
    limit = longest + 4
    cut = encode_pair(LONG, tokenizer, EncodingConfig(max_length=limit, truncation_mode="keep_end", add_bos=True))
    assert cut.chosen_ids == full.chosen_ids and cut.rejected_ids == full.rejected_ids  # completions whole
    assert cut.prompt_ids == [bos] + full.prompt_ids[-3:]  # BOS, then the prompt's last tokens
    assert len(cut.prompt_ids) + longest == limit
    # Without BOS there is nothing to keep at the front.
    nobos = EncodingConfig(max_length=limit, truncation_mode="keep_end", add_bos=False)
    assert encode_pair(LONG, tokenizer, nobos).prompt_ids == full.prompt_ids[-4:]


def test_keep_end_refuses_a_completion_that_fills_the_window(tokenizer):
    full = encode_pair(LONG, tokenizer, CFG)
    limit = len(full.chosen_ids) + 1  # room only for BOS
    cfg = EncodingConfig(max_length=limit, truncation_mode="keep_end", add_bos=True)
    assert reason(LONG, tokenizer, cfg) == "completion_too_long"


def test_error_mode(tokenizer):
    full = encode_pair(LONG, tokenizer, CFG)
    limit = len(full.prompt_ids) + len(full.chosen_ids) - 1
    assert reason(LONG, tokenizer, EncodingConfig(max_length=limit, truncation_mode="error", add_bos=True)) == "too_long"


@pytest.mark.parametrize("extra", [0, 3])
def test_prompt_that_alone_does_not_fit_is_a_bad_row(tokenizer, extra):
    full = encode_pair(LONG, tokenizer, CFG)
    limit = len(full.prompt_ids) - extra  # the prompt fills or overflows the window
    with pytest.raises(BadRowError) as err:
        encode_pair(LONG, tokenizer, EncodingConfig(max_length=limit, truncation_mode="keep_start", add_bos=True))
    assert err.value.reason == "prompt_too_long"
    assert str(len(full.prompt_ids)) in err.value.detail and str(limit) in err.value.detail


# ---------------------------------------------------------------------------------------------------------------
# the BPE boundary


def test_prompt_and_completion_are_tokenized_separately(tokenizer, ids, bos_eos):
    bos, eos = bos_eos
    prompt, completion = "the sky is blue. answer: ", "sure"
    joint, alone = ids(prompt + completion), ids(prompt)
    # Precondition: tokenized as one string, BPE merges across the boundary (" " + "sure" -> " s", "ure"), so the
    # joint ids do not start with the prompt's own ids.
    assert joint[: len(alone)] != alone
    enc = encode_pair({"prompt": prompt, "chosen": completion, "rejected": "no"}, tokenizer, CFG)
    assert enc.prompt_ids == [bos] + alone
    assert enc.chosen_ids == ids(completion) + [eos]
    assert enc.prompt_ids + enc.chosen_ids != [bos] + joint + [eos]


# ---------------------------------------------------------------------------------------------------------------
# bad rows


GOOD = {"prompt": "why?", "chosen": "yes", "rejected": "no"}
CONV = {"prompt": [USER("why?")], "chosen": [ASSISTANT("yes")], "rejected": [ASSISTANT("no")]}
BAD_ROWS = {
    "missing chosen": ({"prompt": "why?", "rejected": "no"}, "missing_field"),
    "missing rejected": ({"prompt": "why?", "chosen": "yes"}, "missing_field"),
    "null chosen": ({**GOOD, "chosen": None}, "missing_field"),
    "int chosen": ({**GOOD, "chosen": 3}, "bad_type"),
    "int prompt": ({**GOOD, "prompt": 7}, "bad_type"),
    "dict prompt": ({**GOOD, "prompt": {"text": "why?"}}, "bad_type"),
    "empty prompt": ({**GOOD, "prompt": ""}, "empty_field"),
    "blank rejected": ({**GOOD, "rejected": "  \n"}, "empty_field"),
    "empty message list": ({**CONV, "chosen": []}, "empty_field"),
    "empty prompt list": ({**CONV, "prompt": []}, "empty_field"),
    "unknown role": ({**CONV, "prompt": [{"role": "bot", "content": "why?"}]}, "bad_role"),
    "user turn in completion": ({**CONV, "chosen": [USER("yes")]}, "bad_role"),
    "message without content": ({**CONV, "prompt": [{"role": "user"}]}, "bad_message"),
    "message not a dict": ({**CONV, "prompt": ["why?"]}, "bad_message"),
    "int content": ({**CONV, "chosen": [{"role": "assistant", "content": 1}]}, "bad_type"),
    "mixed completions": ({**GOOD, "rejected": [ASSISTANT("no")]}, "mixed_format"),
    "string prompt, message completions": ({**CONV, "prompt": "why?"}, "mixed_format"),
    "message prompt, string completions": ({**GOOD, "prompt": [USER("why?")]}, "mixed_format"),
    "implicit, no common prefix": ({"chosen": "yes", "rejected": "no"}, "no_common_prompt"),
    "implicit, no common message": ({"chosen": [USER("a")], "rejected": [USER("b")]}, "no_common_prompt"),
    "implicit, identical": ({"chosen": "why? yes", "rejected": "why? yes"}, "empty_completion"),
}


@pytest.mark.parametrize("name", sorted(BAD_ROWS))
def test_bad_rows(tokenizer, name):
    row, expected = BAD_ROWS[name]
    assert reason(row, tokenizer) == expected


@pytest.mark.parametrize("row", [["why?", "yes", "no"], "why? yes", None, 3])
def test_non_dict_row(tokenizer, row):
    assert reason(row, tokenizer) == "bad_type"


def test_conversational_row_with_template_off(tokenizer):
    assert reason(CONV, tokenizer, EncodingConfig(chat_template="off")) == "needs_chat_template"


def test_good_rows_of_the_bad_row_table_encode(tokenizer):
    # The table's base rows are valid, so each bad row fails for the one thing changed in it.
    assert encode_pair(GOOD, tokenizer, CFG).chosen_ids
    assert encode_pair(CONV, tokenizer, CFG).chosen_ids


# ---------------------------------------------------------------------------------------------------------------
# config, row ids and checksums


def test_encoding_config_validation_and_json():
    with pytest.raises(ValueError, match="max_length"):
        EncodingConfig(max_length=1)
    with pytest.raises(ValueError, match="truncation_mode"):
        EncodingConfig(truncation_mode="keep_middle")
    with pytest.raises(ValueError, match="chat_template"):
        EncodingConfig(chat_template="yes")
    with pytest.raises(ValueError, match="unknown"):
        EncodingConfig.from_dict({**CFG.to_dict(), "padding": "left"})
    cfg = EncodingConfig(max_length=64, truncation_mode="keep_end", chat_template="on", add_bos=False)
    assert EncodingConfig.from_dict(json.loads(cfg.to_json())) == cfg
    assert cfg.to_json() == (
        '{"add_bos":false,"add_eos":true,"chat_template":"on","max_length":64,"truncation_mode":"keep_end"}'
    )


def test_row_id_uses_id_column():
    assert row_id({"id": "r0001", **GOOD}) == "r0001"
    assert row_id({"id": 17, **GOOD}) == "17"
    assert row_id({"id": 0, **GOOD}) == "0"


def test_row_id_without_id_is_a_stable_content_hash():
    rid = row_id(GOOD)
    assert rid.startswith("sha256:") and len(rid) == len("sha256:") + 32
    reordered = {"rejected": "no", "chosen": "yes", "prompt": "why?"}
    assert row_id(reordered) == rid
    assert row_id({**GOOD, "id": None, "source": "x"}) == rid  # other columns do not matter
    blob = json.dumps({"chosen": "yes", "prompt": "why?", "rejected": "no"}, separators=(",", ":"))
    assert rid == "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:32]
    assert rid == "sha256:59f15fd8f394d1f855d35c65aa22634b"  # pinned: cached row ids must not drift
    for key in ("prompt", "chosen", "rejected"):
        assert row_id({**GOOD, key: GOOD[key] + "!"}) != rid
    assert row_id(CONV) != rid and row_id(CONV) == row_id(copy.deepcopy(CONV))


def test_row_mask_checksum_is_pinned():
    c = row_mask_checksum([1, 2, 3], [4, 5], [6])
    assert c == row_mask_checksum((1, 2, 3), [4, 5], [6])  # any sequence type
    # The layout FORMAT.md documents: a tag, the three lengths as little-endian uint64, then the ids as int32.
    blob = b"refcache-mask-v1" + struct.pack("<3Q", 3, 2, 1) + struct.pack("<6i", 1, 2, 3, 4, 5, 6)
    assert c == hashlib.sha256(blob).hexdigest()
    assert c == "b0b3b27a6e88fd5afeb6bb37da21455696364555398974ac5824fde88272c9fa"


def test_checksum_changes_with_any_id_or_boundary():
    base = ([1, 2, 3], [4, 5], [6])
    c = row_mask_checksum(*base)
    variants = [
        ([1, 2, 9], [4, 5], [6]),  # a prompt id
        ([1, 2, 3], [4, 9], [6]),  # a chosen id
        ([1, 2, 3], [4, 5], [9]),  # a rejected id
        ([1, 2], [3, 4, 5], [6]),  # one token moved from prompt to chosen: same concatenation
        ([1, 2, 3, 4], [5], [6]),  # one token moved from chosen to prompt
        ([1, 2, 3], [4], [5, 6]),  # boundary between chosen and rejected
        ([1, 2, 3], [6], [4, 5]),  # chosen and rejected swapped
        ([1, 2, 3], [4, 5], [6, 6]),  # one id longer
        ([1, 2, 3], [4, 5, 6], []),
    ]
    found = {row_mask_checksum(*v) for v in variants}
    assert c not in found and len(found) == len(variants)


def test_encoded_checksum_sees_the_prompt_completion_boundary(tokenizer):
    a = encode_pair({"prompt": "one two", "chosen": " three four", "rejected": " five"}, tokenizer, CFG)
    b = encode_pair({"prompt": "one two three", "chosen": " four", "rejected": " five"}, tokenizer, CFG)
    assert a.prompt_ids + a.chosen_ids == b.prompt_ids + b.chosen_ids  # same chosen sequence ...
    assert a.mask_checksum != b.mask_checksum  # ... but a different scored span
    assert a.mask_checksum == row_mask_checksum(a.prompt_ids, a.chosen_ids, a.rejected_ids)
    # Encoding is deterministic: the same row gives the same checksum every time.
    assert encode_pair(dict(pref_rows(3)[2]), tokenizer, CFG).mask_checksum == encode_pair(
        pref_rows(3)[2], tokenizer, CFG
    ).mask_checksum


# ---------------------------------------------------------------------------------------------------------------
# issue 16 (what a TRL user expects), item 2: BOS follows the tokenizer and the template; old caches keep their encoding


@pytest.mark.parametrize("fmt", ["standard", "conversational", "implicit"])
def test_bos_follows_the_tokenizer_and_template(fmt):
    row = pref_rows(1, fmt=fmt)[0]
    for tok, has_bos in ((gpt2_style(), False), (llama_style(), True)):
        pair = encode_pair(row, tok, EncodingConfig())
        assert (pair.prompt_ids[0] == tok.bos_token_id) is has_bos, (fmt, type(tok))
        assert pair.prompt_ids.count(tok.bos_token_id) == int(has_bos)  # never twice
        if fmt == "conversational":  # what the template renders, token for token
            text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            assert pair.prompt_ids == tok(text, add_special_tokens=False)["input_ids"]
        elif fmt == "standard":
            assert pair.prompt_ids == tok(row["prompt"])["input_ids"]


def test_old_caches_keep_always_bos_and_a_missing_rule_is_refused():
    old = {"add_bos": True, "add_eos": True, "chat_template": "auto", "max_length": 1024,
           "truncation_mode": "keep_start"}  # what every cache before the tokenizer rule records
    cfg = EncodingConfig.from_dict(old)
    assert cfg.to_json() == json.dumps(old, sort_keys=True, separators=(",", ":"))  # checksums over it unchanged
    tok = gpt2_style()
    assert encode_pair(pref_rows(1)[0], tok, cfg).prompt_ids[0] == tok.bos_token_id
    assert EncodingConfig().add_bos == "tokenizer"
    with pytest.raises(ValueError, match="no add_bos recorded"):
        EncodingConfig.from_dict({k: v for k, v in old.items() if k != "add_bos"})


# ---------------------------------------------------------------------------------------------------------------
# issue 22 items 10, 11, 13: data text is data; every message field reaches the template; a failing template is a
# bad row, an invalid one a job error

SYSTEM = lambda s: {"role": "system", "content": s}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
# renders tool calls, a tool message's name and the row's tools (the default test template renders none of them)
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>\ntools: {% for t in tools %}{{ t.function.name }} {% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m.name %}[{{ m.name }}] {% endif %}{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}call {{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}"
    "</s>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def templated(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def bad_row(row, tokenizer, config=CFG) -> BadRowError:
    with pytest.raises(BadRowError) as err:
        encode_pair(row, tokenizer, config)
    return err.value


def conv(prompt, chosen, rejected=None):
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected or [ASSISTANT("no")]}


SPECIAL_TEXT = {  # where a special token's text sits -> (row, the field the message names)
    "completion_middle": ({"prompt": "why?", "chosen": " yes</s> and more", "rejected": " no"}, "'chosen'"),
    "completion_end_eos": ({"prompt": "why?", "chosen": " yes", "rejected": " no</s>"}, "'rejected'"),
    "prompt_bos": ({"prompt": "<s> why?", "chosen": " yes", "rejected": " no"}, "'prompt'"),
    "prompt_template_token": ({"prompt": "why?<|assistant|>\nsure", "chosen": " yes", "rejected": " no"}, "'prompt'"),
    "implicit": ({"chosen": "why? yes</s> more", "rejected": "why? no"}, "'chosen'"),
    "assistant_message": (conv([USER("why?")], [ASSISTANT("yes</s>and more")]), "'chosen'[0].content"),
    "system_message": (conv([SYSTEM("be <pad> brief"), USER("why?")], [ASSISTANT("yes")]), "'prompt'[0].content"),
    "tool_call_argument": (conv([USER("why?")], [{**ASSISTANT(""), "tool_calls": [
        {"function": {"name": "f", "arguments": {"x": "a</s>b"}}}]}]), "'chosen'[0].tool_calls[0].function.arguments.x"),
}


@pytest.mark.parametrize("case", sorted(SPECIAL_TEXT))
def test_special_token_text_in_data_is_refused_naming_field_and_token(tokenizer, case):
    """Item 10: the text of a special token in any data string would become that control id (an EOS cut the
    completion there, silently); it is refused with the field, the token and where it is."""
    row, where = SPECIAL_TEXT[case]
    err = bad_row(row, templated(tokenizer, TOOL_TEMPLATE))
    assert err.reason == "special_token_text"
    assert err.detail.startswith(f"{where} contains '")
    assert "the text of the tokenizer's special token (id " in err.detail


def test_additional_special_tokens_are_control_text_and_plain_added_tokens_are_vocabulary(tokenizer, ids, bos_eos):
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tok.add_tokens(["<calc>"])  # an added token that is not special: ordinary vocabulary, read as it always is
    row = {"prompt": "why?", "chosen": " yes <|tool|> sure", "rejected": " no"}
    assert bad_row(row, tok).detail.startswith("'chosen' contains '<|tool|>'")
    ok = encode_pair({**row, "chosen": " yes <calc> sure"}, tok, CFG)
    assert tok.convert_tokens_to_ids("<calc>") in ok.chosen_ids
    assert tok.decode(ok.chosen_ids) == " yes <calc> sure</s>"  # nothing after the token is lost


def test_text_without_special_tokens_encodes_as_before(tokenizer, ids, bos_eos):
    """The rule refuses rows; it never changes how an accepted row is tokenized (existing caches stay valid)."""
    bos, eos = bos_eos
    row = {"prompt": "a < s > b </ s> <|user| >", "chosen": " yes </S>", "rejected": " no"}
    enc = encode_pair(row, tokenizer, CFG)
    assert enc.prompt_ids == [bos] + ids(row["prompt"]) and enc.chosen_ids == ids(" yes </S>") + [eos]


def test_tool_calls_reach_the_chat_template(tokenizer, ids):
    """Item 11: an assistant message's tool_calls used to be dropped before the template; it renders them now."""
    tok = templated(tokenizer, TOOL_TEMPLATE)
    row = conv([USER("weather?")], [{**ASSISTANT(""), "tool_calls": [CALL]}], [ASSISTANT("no idea")])
    enc = encode_pair(row, tok, CFG)
    full = tok.apply_chat_template(row["prompt"] + row["chosen"], tokenize=False)
    assert 'call get_weather({"city": "Paris"})' in full
    assert tok.decode(enc.chosen_ids) == 'call get_weather({"city": "Paris"})</s>'
    assert enc.prompt_ids + enc.chosen_ids == [tok.bos_token_id] + ids(full.removesuffix("\n"))


FIELDS = {  # a message field the default template does not render -> the field the message names
    "tool_calls": (conv([USER("weather?")], [{**ASSISTANT(""), "tool_calls": [CALL]}]), "'chosen'[0].tool_calls"),
    "tool_message_name": (conv([USER("weather?"), {**ASSISTANT(""), "tool_calls": [CALL]},
                                {"role": "tool", "content": "sunny", "name": "get_weather", "tool_call_id": "c1"}],
                               [ASSISTANT("sunny")]), "'prompt'[1].tool_calls"),
    "reasoning_content": (conv([USER("why?")], [ASSISTANT("yes")], [{**ASSISTANT("no"), "reasoning_content": "hm"}]),
                          "'rejected'[0].reasoning_content"),
    "unknown_key": (conv([{**USER("why?"), "weight": 1}], [ASSISTANT("yes")]), "'prompt'[0].weight"),
    "implicit": ({"chosen": [{**USER("q"), "thinking": "x"}, ASSISTANT("a")], "rejected": [
        {**USER("q"), "thinking": "x"}, ASSISTANT("b")]}, "'chosen'[0].thinking"),
}


@pytest.mark.parametrize("case", sorted(FIELDS))
def test_a_message_field_the_template_does_not_render_is_refused(tokenizer, case):
    row, where = FIELDS[case]
    err = bad_row(row, tokenizer)
    assert err.reason == "field_not_rendered"
    assert err.detail.startswith(f"{where} is not rendered by the chat template, so it would be dropped")


def test_tool_message_fields_and_tools_reach_the_template(tokenizer):
    tok = templated(tokenizer, TOOL_TEMPLATE)
    tool_msg = {"role": "tool", "content": "sunny", "name": "get_weather", "tool_call_id": "c1"}
    row = conv([USER("weather?"), {**ASSISTANT(""), "tool_calls": [CALL]}, tool_msg], [ASSISTANT("sunny")])
    # tool_call_id is not rendered by this template: refused, naming it
    assert bad_row(row, tok).detail.startswith("'prompt'[2].tool_call_id is not rendered")
    row["prompt"][2].pop("tool_call_id")
    text = tok.decode(encode_pair(row, tok, CFG).prompt_ids)
    assert "[get_weather] sunny" in text and "call get_weather" in text
    schema = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    with_tools = encode_pair({**row, "tools": json.dumps(schema)}, tok, CFG)  # TRL's JSON-string form too
    assert "tools: get_weather" in tok.decode(with_tools.prompt_ids)
    assert bad_row({**row, "tools": schema}, tokenizer).detail.startswith("'prompt'[1].tool_calls")
    plain = {"prompt": "why?", "chosen": " yes", "rejected": " no", "tools": schema}
    assert bad_row(plain, tokenizer).reason == "field_not_rendered"


def test_null_and_empty_message_fields_encode_as_without_them(tokenizer):
    """Loaders fill a key that only some messages have with null in the others: nothing to render, nothing lost."""
    row = conv([USER("why?")], [ASSISTANT("yes")])
    filled = conv([{**USER("why?"), "tool_calls": None}], [{**ASSISTANT("yes"), "tool_calls": [],
                                                            "reasoning_content": None}])
    assert encode_pair(filled, tokenizer, CFG) == encode_pair(row, tokenizer, CFG)
    bytes_field = conv([{**USER("why?"), "name": b"x"}], [ASSISTANT("yes")])
    assert bad_row(bytes_field, tokenizer).reason == "bad_type"


RAISING = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages please') }}"
           "{% endif %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SANDBOX = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ messages.append(m) }}{% endif %}"
           "<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.mark.parametrize("template,error", [(RAISING, "TemplateError: no system messages please"),
                                            (SANDBOX, "SecurityError: ")])
def test_a_template_that_fails_on_a_row_makes_that_row_bad(tokenizer, template, error):
    """Item 13: raise_exception or a sandbox violation on one row is that row's problem; other rows encode."""
    tok = templated(tokenizer, template)
    err = bad_row(conv([SYSTEM("be brief"), USER("why?")], [ASSISTANT("yes")]), tok)
    assert err.reason == "template_error"
    assert err.detail.startswith(f"the chat template failed on this row ({error}")
    ok = conv([USER("why?")], [ASSISTANT("yes")])
    assert encode_pair(ok, tok, CFG) == encode_pair(ok, tokenizer, CFG)


def test_an_invalid_template_fails_the_job_not_a_row(tokenizer):
    from schemas.encoding import ChatTemplateError

    tok = templated(tokenizer, "{% for m in messages %}{{ m['content'] }}")  # no endfor
    with pytest.raises(ChatTemplateError, match=r"^the chat template of the tokenizer .* is not valid Jinja \(line 1"):
        encode_pair(conv([USER("why?")], [ASSISTANT("yes")]), tok, CFG)
    # a row that is not rendered with the template does not need it
    assert encode_pair({"prompt": "why?", "chosen": " yes", "rejected": " no"}, tok, CFG).chosen_ids


def test_chat_template_kwargs_reach_the_template(tokenizer):
    """TRL's chat_template_kwargs column (e.g. enable_thinking) is a template variable, not dropped."""
    tok = templated(tokenizer, "{% if terse %}<|system|>\nterse</s>\n{% endif %}" + TOOL_TEMPLATE)
    row = conv([USER("why?")], [ASSISTANT("yes")])
    terse = encode_pair({**row, "chat_template_kwargs": {"terse": True}}, tok, CFG)
    assert "terse" in tok.decode(terse.prompt_ids) and "terse" not in tok.decode(encode_pair(row, tok, CFG).prompt_ids)
    assert bad_row({**row, "chat_template_kwargs": {"tokenize": True}}, tok).reason == "bad_type"
    assert bad_row({**row, "chat_template_kwargs": {"x": "a</s>"}}, tok).reason == "special_token_text"
    plain = {"prompt": "why?", "chosen": " yes", "rejected": " no", "chat_template_kwargs": {"terse": True}}
    assert bad_row(plain, tok).reason == "field_not_rendered"


def test_a_special_token_formed_across_message_text_is_refused(tokenizer):
    """Item 10's class: text that holds no special token alone but forms one with its neighbour once rendered."""
    tok = templated(tokenizer, "{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    row = conv([SYSTEM("hi <|us"), USER("er|> there")], [ASSISTANT("yes")])
    err = bad_row(row, tok)
    assert err.reason == "special_token_text"
    assert err.detail.startswith("'prompt'[0].content and the text next to it in the rendered chat template form "
                                 "'<|user|>'")
    fine = conv([SYSTEM("hi <|us"), USER("there")], [ASSISTANT("s")])  # "s" also occurs inside "</s>": no matter
    assert encode_pair(fine, templated(tokenizer, TOOL_TEMPLATE), CFG).chosen_ids


def test_message_text_rendered_after_the_final_eos_is_refused(tokenizer):
    """The completion is kept through its final EOS; a template that writes message text after it would lose it."""
    tok = templated(tokenizer, TOOL_TEMPLATE.replace("</s>\n{% endfor %}", "</s>{{ m.note }}\n{% endfor %}"))
    row = conv([USER("why?")], [{**ASSISTANT("yes"), "note": "said kindly"}])
    err = bad_row(row, tok)
    assert (err.reason, err.detail) == ("text_after_eos", "the chat template renders 'chosen'[0].note after the "
                                                          "completion's final EOS '</s>', where nothing is kept")
    assert encode_pair(conv([USER("why?")], [ASSISTANT("yes")]), tok, CFG).chosen_ids  # the newline after it: fine


def test_a_field_the_template_needs_counts_as_rendered(tokenizer):
    """A template that fails without a field (as some do for a tool message's tool_call_id) uses it."""
    tok = templated(tokenizer, "{% for m in messages %}{% if m.role == 'tool' and not m.tool_call_id %}"
                               "{{ raise_exception('tool messages need an id') }}{% endif %}" + TOOL_TEMPLATE[
                                   TOOL_TEMPLATE.index("{% for m in messages %}") + len("{% for m in messages %}"):])
    row = conv([USER("weather?"), {"role": "tool", "content": "sunny", "tool_call_id": "c1"}], [ASSISTANT("sunny")])
    assert "sunny" in tok.decode(encode_pair(row, tok, CFG).prompt_ids)


# ---------------------------------------------------------------------------------------------------------------
# issue 25 (TRL recipes), item 4: a column mapping is part of the encoding, recorded only when set


def test_column_mapping_is_recorded_in_one_form_and_only_when_set():
    from schemas.encoding import rename_columns

    cfg = EncodingConfig(columns=" chosen=response_j, prompt=question,rejected=response_k")
    assert cfg.columns == "prompt=question,chosen=response_j,rejected=response_k"  # targets in the encoder's order
    assert cfg == EncodingConfig(columns={"rejected": "response_k", "prompt": "question", "chosen": "response_j"})
    assert json.loads(cfg.to_json())["columns"] == cfg.columns
    assert EncodingConfig.from_dict(json.loads(cfg.to_json())) == cfg
    # without it the JSON is byte for byte what every earlier cache records (the mask checksums are taken over it)
    assert EncodingConfig().to_json() == ('{"add_bos":"tokenizer","add_eos":true,"chat_template":"auto",'
                                          '"max_length":1024,"truncation_mode":"keep_start"}')
    assert "columns" not in EncodingConfig().to_dict()
    assert EncodingConfig(columns="prompt=prompt").columns is None  # naming a column as itself renames nothing
    row = {"question": "why?", "response_j": "yes", "response_k": "no", "score": 3}
    assert rename_columns(row, cfg.columns) == {"score": 3, **GOOD}
    swapped = EncodingConfig(columns="chosen=rejected,rejected=chosen").columns
    assert rename_columns(GOOD, swapped) == {"prompt": "why?", "chosen": "no", "rejected": "yes"}


@pytest.mark.parametrize("text,error", [
    ("prompt=a,prompt=b", r"columns: prompt is mapped twice \(prompt=a, prompt=b\)"),
    ("prompt=a,chosen=a", r"column 'a' is mapped twice \(prompt=a, chosen=a\)"),
    ("question=prompt", r"'question' is not a column refcache reads \(targets: id, prompt, chosen"),
    ("prompt:question", r"'prompt:question' is not TARGET=COLUMN"),
    ("prompt=", r"prompt= names no column"),
])
def test_column_mapping_errors_name_the_item(text, error):
    with pytest.raises(ValueError, match=error):
        EncodingConfig(columns=text)


def test_data_readme_shows_the_completion_tokens_the_encoder_keeps():
    """Issue 25 item 11: data/README.md's worked example is what encode_pair gives with data/sft-model's tokenizer:
    the prompt tokens, and completion tokens that end with the EOS (the template's newline after it is not kept)."""
    from transformers import AutoTokenizer

    from conftest import DATA

    tok = AutoTokenizer.from_pretrained(DATA / "sft-model")
    row = {"prompt": [{"role": "user", "content": "Add 3 and 4."}],
           "chosen": [{"role": "assistant", "content": "Sure! 3 plus 4 is 7."}],
           "rejected": [{"role": "assistant", "content": "Hmm. 3 plus 4 is 7."}]}
    pair = encode_pair(row, tok, EncodingConfig())
    assert pair.chosen_ids[-1] == tok.eos_token_id
    assert tok.apply_chat_template(row["prompt"] + row["chosen"], tokenize=False).endswith(tok.eos_token + "\n")
    readme = " ".join((DATA / "README.md").read_text().split())
    shown = lambda ids: "`" + " ".join(tok.convert_ids_to_tokens(ids)) + "`"
    assert shown(pair.prompt_ids) in readme and shown(pair.chosen_ids) in readme
    assert "newline after it" not in readme and "</s> Ċ`" not in readme


# ---------------------------------------------------------------------------------------------------------------
# issue 34 family 8: the special-token rule reads token ids, after the tokenizer's own normalisation


def nfkc(tokenizer, normalized_eos=True):
    """The test tokenizer under an NFKC normaliser, its EOS matched after normalisation (normalized=True, as some
    converted tokenizers have it): fullwidth '＜/s＞' and small-form '﹤/s﹥' then become the EOS id."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast

    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.normalizer = normalizers.NFKC()
    backend.add_special_tokens([AddedToken("</s>", special=True, normalized=normalized_eos)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = tokenizer.chat_template
    return tok


NORMALISED_EOS = {"fullwidth": "＜/s＞", "small_form": "﹤/s﹥"}


@pytest.mark.parametrize("case", sorted(NORMALISED_EOS))
def test_text_that_normalises_to_eos_is_refused_by_its_token_ids(tokenizer, case):
    """Under NFKC the text becomes the EOS id, which cut the completion there (silently); the rule now encodes each
    field's text and looks for control ids, so it is refused naming the field, the text, the token and where."""
    tok = nfkc(tokenizer)
    text = NORMALISED_EOS[case]
    assert tok.eos_token_id in tok(f" yes {text} more", add_special_tokens=False)["input_ids"]  # what it guards
    for row, where, at in (({"prompt": "why?", "chosen": f" yes {text} more", "rejected": " no"}, "'chosen'", 5),
                           ({"prompt": f"why {text}?", "chosen": " yes", "rejected": " no"}, "'prompt'", 4),
                           (conv([USER("why?")], [ASSISTANT(f"yes {text} more")]), "'chosen'[0].content", 4),
                           (conv([USER("why?")], [{**ASSISTANT(""), "tool_calls": [
                               {"function": {"name": "f", "arguments": {"x": f"a{text}"}}}]}]),
                            "'chosen'[0].tool_calls[0].function.arguments.x", 1)):
        err = bad_row(row, templated(tok, TOOL_TEMPLATE))
        assert (err.reason, err.detail.split(";")[0]) == (
            "special_token_text", f"{where} contains {text!r} (which the tokenizer reads as '</s>'), the text of the "
                                  f"tokenizer's special token (id {tok.eos_token_id}), at character {at}")


def test_normalised_text_the_tokenizer_does_not_read_as_a_control_token_is_data(tokenizer):
    """The same NFKC normaliser with EOS matched on the raw text only (normalized=False, the usual setting): the
    fullwidth text is ordinary text there, encoded as it always was; a literal '</s>' is still refused."""
    tok = nfkc(tokenizer, normalized_eos=False)
    row = {"prompt": "why?", "chosen": " yes ＜/s＞ more", "rejected": " no"}
    enc = encode_pair(row, tok, CFG)
    assert tok.eos_token_id not in enc.chosen_ids[:-1] and enc.chosen_ids[-1] == tok.eos_token_id
    assert enc.chosen_ids[:-1] == tok(row["chosen"], add_special_tokens=False)["input_ids"]
    err = bad_row({**row, "chosen": " yes </s> more"}, tok)
    assert err.detail.startswith("'chosen' contains '</s>', the text of the tokenizer's special token (id ")
    assert "at character 5;" in err.detail


def test_the_rule_reads_the_ids_of_any_tokenizer_and_not_raw_strings():
    """A word-level tokenizer with an unknown-token id: a character the vocabulary lacks is read as the unk id,
    which is vocabulary (accepted, as before), while the unk token's own text, also after normalisation, is
    control text (refused); an uppercase '</S>' that a lowercasing normaliser turns into the EOS is refused too."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "why", "?", "yes", "no", "more"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=True) for t in ("<unk>", "<s>", "</s>")])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    unknown = encode_pair({"prompt": "why ?", "chosen": "yes zebra", "rejected": "no"}, tok, CFG)
    assert unknown.chosen_ids == [vocab["yes"], vocab["<unk>"], vocab["</s>"]]
    for chosen, text, token in (("yes <UNK> more", "<UNK>", "<unk>"), ("yes </S> more", "</S>", "</s>"),
                                ("yes ＜/s＞", "＜/s＞", "</s>")):
        err = bad_row({"prompt": "why ?", "chosen": chosen, "rejected": "no"}, tok)
        assert err.detail.startswith(f"'chosen' contains {text!r} (which the tokenizer reads as {token!r}), the text "
                                     f"of the tokenizer's special token (id {vocab[token]}), at character 4;"), err.detail


def test_a_control_token_formed_across_messages_only_after_normalisation_is_refused(tokenizer):
    """The formed-across-message-edges check reads the rendered text's control ids too: '＜/s' in one message and
    '＞' in the next are the EOS once the NFKC tokenizer reads them together."""
    tok = templated(nfkc(tokenizer), "{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                     "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    err = bad_row(conv([SYSTEM("hi ＜/s"), USER("＞ there")], [ASSISTANT("yes")]), tok)
    assert (err.reason, err.detail) == ("special_token_text", "'prompt'[0].content and the text next to it in the "
                                        "rendered chat template form '</s>', the text of the tokenizer's special "
                                        "token; data text is never read as control tokens")
    assert bad_row(conv([SYSTEM("hi ＜/"), USER("there")], [ASSISTANT("yes")]), tok).reason == "template_not_prefix"
def test_completion_end_template_keeps_what_the_template_writes_after_the_eos(tokenizer):
    """completion_end template (TRL's DPOTrainer's completion): the template's text after the final EOS (here a
    newline) is part of the completion and scored, message text rendered there is kept rather than refused; the
    default (eos) ends the completion at the EOS, and is not written into the encoding's JSON (old caches keep it)."""
    tok = templated(tokenizer, TOOL_TEMPLATE.replace("</s>\n{% endfor %}", "</s>{{ m.note }}\n{% endfor %}"))
    trl_end = EncodingConfig(add_bos=True, completion_end="template")
    row = conv([USER("why?")], [ASSISTANT("yes")])
    eos, template = encode_pair(row, tok, CFG), encode_pair(row, tok, trl_end)
    assert eos.chosen_ids[-1] == tok.eos_token_id and eos.prompt_ids == template.prompt_ids
    assert template.chosen_ids[:len(eos.chosen_ids)] == eos.chosen_ids
    assert tok.decode(template.chosen_ids[len(eos.chosen_ids):]) == "\n"
    noted = conv([USER("why?")], [{**ASSISTANT("yes"), "note": "said kindly"}])
    assert "said kindly" in tok.decode(encode_pair(noted, tok, trl_end).chosen_ids)
    plain = {"prompt": "why?", "chosen": " yes", "rejected": " no"}  # not templated: EOS added in both modes
    assert encode_pair(plain, tok, trl_end) == encode_pair(plain, tok, CFG)
    assert "completion_end" not in CFG.to_dict() and trl_end.to_dict()["completion_end"] == "template"
    assert EncodingConfig.from_dict(trl_end.to_dict()) == trl_end
    with pytest.raises(ValueError, match="completion_end must be one of"):
        EncodingConfig(completion_end="newline")


@pytest.mark.parametrize("key,value", [("max_length", 1024.0), ("max_length", 8.5), ("max_length", float("inf")),
                                       ("max_length", 1e30), ("max_length", -3), ("max_length", True),
                                       ("max_length", "64"), ("truncation_mode", 3), ("chat_template", ["on"]),
                                       ("completion_end", None), ("add_eos", 1), ("add_bos", "yes"),
                                       ("columns", {"prompt": "q"})])
def test_from_dict_refuses_a_value_refcache_never_writes_rather_than_coercing_it(key, value):
    """A record is read as written: 1024.0 is not 1024 (the mask checksums hash the encoding's JSON), a bool is not a
    number; the error names the key, so a damaged cache is refused naming it (precompute/config.py)."""
    with pytest.raises(RecordedEncodingError, match=f"encoding '{key}' is") as e:
        EncodingConfig.from_dict({**EncodingConfig().to_dict(), key: value})
    assert e.value.key == key
    assert EncodingConfig.from_dict(EncodingConfig().to_dict()) == EncodingConfig()  # what it writes reads back
