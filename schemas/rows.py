"""A preference row's fields, checked and read (schemas/encoding.py encodes them): its prompt and completions as text
or messages (the prompt split off as TRL does where the row has none), every string valid Unicode, every message a
role and text plus the fields the chat template reads, and what is wrong with a row that cannot be used (`BadRowError`,
with a stable reason to count skips by)."""

from __future__ import annotations

from typing import Any


ROLES = ("system", "user", "assistant", "tool")


class BadRowError(ValueError):
    """A preference row that cannot be encoded. `reason` is a short stable key used to count skips."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _text(value: str, what: str) -> str:
    """`value` if it is valid Unicode text (JSON's \\ud800 escapes can produce lone surrogates, which no tokenizer or
    Parquet file accepts)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRowError(
            "bad_text", f"{what} is not valid Unicode text (lone surrogate {value[e.start]!r} at character {e.start})"
        ) from None
    return value


def _check_value(value: Any, where: str) -> None:
    """A message field other than role/content: what JSON holds (the template reads it), its text valid Unicode."""
    if isinstance(value, str):
        _text(value, where)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_value(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise BadRowError("bad_type", f"{where} has a key of type {type(k).__name__}, not text")
            _text(k, f"a key of {where}")
            _check_value(v, f"{where}.{k}")
    elif value is not None and not isinstance(value, (bool, int, float)):
        raise BadRowError("bad_type", f"{where} is {type(value).__name__}, which JSON cannot hold")


def _check_messages(value: Any, field: str) -> list[dict]:
    """The messages with every field they carry, so that the chat template sees all of them (a field it does not
    render is refused in `_render`). A null field is left out: loaders fill a key that only some messages have
    with null in the others, and a template may test for the key."""
    if not value:
        raise BadRowError("empty_field", f"'{field}' is an empty message list")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise BadRowError("bad_message", f"'{field}'[{i}] is not a {{'role', 'content'}} message")
        if m["role"] not in ROLES:
            raise BadRowError("bad_role", f"'{field}'[{i}] has role {m['role']!r}; expected one of {ROLES}")
        if not isinstance(m["content"], str):
            raise BadRowError("bad_type", f"'{field}'[{i}].content is {type(m['content']).__name__}, not text")
        _text(m["content"], f"'{field}'[{i}].content")
        for key, v in m.items():
            if key not in ("role", "content"):
                if not isinstance(key, str):
                    raise BadRowError("bad_type", f"'{field}'[{i}] has a key of type {type(key).__name__}")
                _check_value(v, f"'{field}'[{i}].{key}")
        out.append({"role": m["role"], "content": m["content"],
                    **{k: v for k, v in m.items() if k not in ("role", "content") and v is not None}})
    return out


def _field(row: dict, key: str):
    value = row.get(key)
    if value is None:
        # "or null": loaders fill a key missing from some rows with null, so the two cannot be told apart here
        raise BadRowError("missing_field", f"row has no '{key}' value (missing or null; keys: {sorted(row)})")
    if isinstance(value, str):
        if not value.strip():
            raise BadRowError("empty_field", f"'{key}' is an empty string")
        return _text(value, f"'{key}'")
    if isinstance(value, list):
        return _check_messages(value, key)
    raise BadRowError("bad_type", f"'{key}' is {type(value).__name__}; expected a string or a list of messages")


def _data_texts(value, where: str):
    """(where, text) for every string of a row field that reaches the tokenizer, message fields and keys included."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _data_texts(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _data_texts(k, f"a key of {where}")
            yield from _data_texts(v, f"{where}.{k}")


def _split_implicit_prompt(chosen, rejected):
    """TRL's implicit-prompt format: the prompt is the longest common prefix of chosen and rejected."""
    if isinstance(chosen, list):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise BadRowError("no_common_prompt", "chosen and rejected share no leading messages")
        return chosen[:n], chosen[n:], rejected[n:]
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    # Back up to the last whitespace so the completions start on a word boundary (the space goes with them).
    cut = max(chosen.rfind(" ", 0, n), chosen.rfind("\n", 0, n)) if n < min(len(chosen), len(rejected)) else n
    cut = cut if cut > 0 else n
    if cut == 0:
        raise BadRowError("no_common_prompt", "chosen and rejected share no common prefix")
    return chosen[:cut], chosen[cut:], rejected[cut:]


def parse_row(row: dict):
    """Validate a row and return (prompt, chosen, rejected, conversational)."""
    if not isinstance(row, dict):
        raise BadRowError("bad_type", f"row is {type(row).__name__}, not an object")
    chosen, rejected = _field(row, "chosen"), _field(row, "rejected")
    if type(chosen) is not type(rejected):
        raise BadRowError("mixed_format", "'chosen' and 'rejected' mix strings and message lists")
    if "prompt" not in row:
        prompt, chosen, rejected = _split_implicit_prompt(chosen, rejected)
    else:
        prompt = _field(row, "prompt")
        if type(prompt) is not type(chosen):
            raise BadRowError("mixed_format", "'prompt' and the completions mix strings and message lists")
    conversational = isinstance(chosen, list)
    for name, comp in (("chosen", chosen), ("rejected", rejected)):
        if not comp or (isinstance(comp, str) and not comp.strip()):
            raise BadRowError("empty_completion", f"'{name}' completion is empty")
        if conversational and any(m["role"] != "assistant" for m in comp):
            raise BadRowError("bad_role", f"'{name}' completion must hold assistant messages only")
    return prompt, chosen, rejected, conversational
