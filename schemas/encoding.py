"""The one function that turns a preference row into token ids.

Every side of refcache (precompute, train, audit) tokenizes preference data through `encode_pair`, so the
ids the reference was scored on and the ids the policy trains on cannot drift apart.

Accepted rows follow TRL's preference formats:
  standard        {"prompt": str, "chosen": str, "rejected": str}
  conversational  {"prompt": [msg...], "chosen": [msg...], "rejected": [msg...]}
  implicit prompt {"chosen": ..., "rejected": ...}  (the prompt is their longest common prefix)

Prompt and completion are tokenized separately and concatenated (never tokenized as one string), so prompt
ids are always a prefix of the full sequence even where BPE would merge across the boundary. A completion is
scored from its first token through the final EOS; nothing after that EOS is kept.

BOS follows the tokenizer and the template, as the SFT model saw it (and as TRL does): plain text gets the special
tokens the tokenizer itself puts before a text (none for GPT-2/Pythia style tokenizers), chat-templated text gets
exactly what the template renders. Caches made before this rule record `add_bos: true` (always prepend BOS) and are
still encoded that way, so they verify unchanged.

Data text is data, and none of it is dropped: a row holding the text of a special token is refused (it would be read
as that control token, and an EOS in a completion would end it there), every field of a message and the row's
`tools` / `chat_template_kwargs` reach the chat template (a field the template does not render is refused), and a
template that fails on a row makes a bad row. Rows without such text are tokenized exactly as before.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import weakref
from dataclasses import dataclass
from typing import Any

TRUNCATION_MODES = ("keep_start", "keep_end", "error")
# "tokenizer": follow the tokenizer's own special tokens for plain text and the template for templated text.
# True / False: always / never prepend BOS (True is what every cache written before the "tokenizer" rule records).
BOS_MODES = ("tokenizer", True, False)
CHAT_TEMPLATE_MODES = ("auto", "on", "off")
# where a chat-templated completion ends: at its final EOS (refcache's own), or where the template's text ends (TRL's
# DPOTrainer, which scores whatever the template writes after the EOS, e.g. a newline)
COMPLETION_END_MODES = ("eos", "template")
ROLES = ("system", "user", "assistant", "tool")
# the columns the encoder reads, in the order a column mapping is written
COLUMNS = ("id", "prompt", "chosen", "rejected", "tools", "chat_template_kwargs")


def column_mapping(value) -> str | None:
    """A column mapping, `TARGET=COLUMN,...` (or a mapping {target: column}), in its one written form: targets in
    COLUMNS order, a column named as itself left out (None when nothing is renamed). Raises ValueError naming the
    item for anything else: an item that is not TARGET=COLUMN, a target the encoder does not read, a target or a
    column twice."""
    if value is None:
        return None
    if isinstance(value, dict):
        items = [(str(k), "" if v is None else str(v)) for k, v in value.items()]
    elif isinstance(value, str):
        items = []
        for item in (part.strip() for part in value.split(",")):
            if item.count("=") != 1:
                raise ValueError(f"{item!r} is not TARGET=COLUMN (e.g. prompt=question,chosen=response_j)")
            target, column = (x.strip() for x in item.split("="))
            items.append((target, column))
    else:
        raise ValueError(f"expected TARGET=COLUMN,... or a mapping, got {type(value).__name__}")
    mapping: dict[str, str] = {}
    for target, column in items:
        if target not in COLUMNS:
            raise ValueError(f"{target!r} is not a column refcache reads (targets: {', '.join(COLUMNS)})")
        if not column:
            raise ValueError(f"{target}= names no column")
        if target in mapping:
            raise ValueError(f"{target} is mapped twice ({target}={mapping[target]}, {target}={column})")
        twice = [t for t, c in mapping.items() if c == column]
        if twice:
            raise ValueError(f"column {column!r} is mapped twice ({twice[0]}={column}, {target}={column})")
        mapping[target] = column
    text = ",".join(f"{t}={mapping[t]}" for t in COLUMNS if t in mapping and mapping[t] != t)
    return text or None


def column_pairs(columns: str | None) -> dict[str, str]:
    """{target: column} of a column_mapping text ({} for None)."""
    return dict(item.split("=", 1) for item in columns.split(",")) if columns else {}


def rename_columns(row: dict, columns: str | None) -> dict:
    """The row under the encoder's names (`columns`: a column_mapping text): each mapped column renamed to its
    target, the others kept. The caller has checked that no kept column already has a target's name."""
    if not columns or not isinstance(row, dict):
        return row
    mapping = column_pairs(columns)
    sources = set(mapping.values())
    kept = {k: v for k, v in row.items() if k not in sources and k not in mapping}
    return {**kept, **{target: row.get(column) for target, column in mapping.items()}}


class BadRowError(ValueError):
    """A preference row that cannot be encoded. `reason` is a short stable key used to count skips."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class EncodingConfig:
    """How rows become ids. Recorded in every cache; training must use the same values."""

    max_length: int = dataclasses.field(default=1024, metadata={
        "help": "Maximum prompt + completion tokens per sequence.", "domain": "count", "min": 2})
    truncation_mode: str = dataclasses.field(default="keep_start", metadata={
        "choices": TRUNCATION_MODES, "help": "Over-long pairs: keep_start cuts completion ends, keep_end cuts the "
                                             "prompt start, error rejects the row."})
    chat_template: str = dataclasses.field(default="auto", metadata={
        "choices": CHAT_TEMPLATE_MODES, "help": "Apply the tokenizer's chat template: auto (conversational rows "
                                                "only), on (also wrap plain strings), off."})
    # one of BOS_MODES (see the module docstring); not an option: "tokenizer" is what the SFT model saw
    add_bos: bool | str = dataclasses.field(default="tokenizer", metadata={"cli": False})
    add_eos: bool = dataclasses.field(default=True, metadata={"cli": False})  # end completions with EOS
    completion_end: str = dataclasses.field(default="eos", metadata={
        "choices": COMPLETION_END_MODES, "help": "Where a chat-templated completion ends: eos (at its final EOS; "
                                                 "template text after it is not scored) or template (all the text "
                                                 "the template writes after the prompt, as TRL's DPOTrainer scores "
                                                 "it). Recorded in the cache."})
    # which data columns are prompt/chosen/rejected/...; recorded only when set, so that every encoding made without
    # it keeps its JSON (and the mask checksums over it)
    columns: str | None = dataclasses.field(default=None, metadata={
        "parse": column_mapping, "metavar": "TARGET=COLUMN,...",
        "help": "Data columns under other names, as TARGET=COLUMN pairs joined by commas, e.g. "
                "prompt=question,chosen=good,rejected=bad (targets: id, prompt, chosen, rejected, tools, "
                "chat_template_kwargs). Recorded in the cache."})

    def __post_init__(self):
        if self.max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {self.max_length}")
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, got {self.truncation_mode!r}")
        if self.completion_end not in COMPLETION_END_MODES:
            raise ValueError(f"completion_end must be one of {COMPLETION_END_MODES}, got {self.completion_end!r}")
        if self.chat_template not in CHAT_TEMPLATE_MODES:
            raise ValueError(f"chat_template must be one of {CHAT_TEMPLATE_MODES}, got {self.chat_template!r}")
        if not any(self.add_bos is m or self.add_bos == m and isinstance(m, str) for m in BOS_MODES):
            raise ValueError(f"add_bos must be 'tokenizer', true or false, got {self.add_bos!r}")
        try:
            object.__setattr__(self, "columns", column_mapping(self.columns))
        except ValueError as e:
            raise ValueError(f"columns: {e}") from None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d["columns"] is None:  # as every encoding before column mappings: same JSON, same checksums
            del d["columns"]
        if d["completion_end"] == "eos":  # likewise: recorded only for TRL's end
            del d["completion_end"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "EncodingConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown encoding config fields: {sorted(unknown)}")
        if "add_bos" not in d:  # its default changed: a missing value cannot be told apart, so never assume one
            raise ValueError("no add_bos recorded, so the BOS rule the ids were made with is unknown; re-run "
                             "precompute-ref with this version of refcache")
        return cls(**d)


@dataclass(frozen=True)
class EncodedPair:
    prompt_ids: list[int]
    chosen_ids: list[int]  # completion tokens only
    rejected_ids: list[int]

    @functools.cached_property  # read by plan, job stamps, update and verify: each pair hashed once
    def mask_checksum(self) -> str:
        return row_mask_checksum(self.prompt_ids, self.chosen_ids, self.rejected_ids)


def row_mask_checksum(prompt_ids, chosen_ids, rejected_ids) -> str:
    """sha256 over the three id lists and their boundaries (lengths), as little-endian int32/uint64."""
    import numpy as np

    h = hashlib.sha256(b"refcache-mask-v1")
    parts = [np.asarray(p, dtype="<i4") for p in (prompt_ids, chosen_ids, rejected_ids)]
    h.update(np.array([len(p) for p in parts], dtype="<u8").tobytes())
    for p in parts:
        h.update(p.tobytes())
    return h.hexdigest()


def row_id(row: dict) -> str:
    """The row's `id` column when present, else a stable hash of its preference content.

    Raises BadRowError for an id that is not valid text. The hash is computed for any content (values JSON cannot
    hold, lone surrogates) so that a bad row can still be named where it is reported."""
    if row.get("id") is not None:
        return _text(str(row["id"]), "'id'")
    content = {k: row.get(k) for k in ("prompt", "chosen", "rejected")}
    blob = json.dumps(content, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=repr)
    return "sha256:" + hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()[:32]


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


# ---------------------------------------------------------------------------------------------------------------
# row validation and prompt extraction


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


_CONTROLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its added tokens' state, texts)


def control_tokens(tokenizer) -> list[str]:
    """The texts the tokenizer reads as control tokens: its named special tokens (bos, eos, pad, ... and the
    additional ones) and every added token flagged special. Added tokens that are not special are ordinary
    vocabulary (the tokenizer reads them in any text, as it did when the model was trained) and are not listed."""
    state = (len(tokenizer), tuple(str(getattr(tokenizer, f"{k}_token", None)) for k in ("bos", "eos", "pad", "unk")))
    try:
        cached = _CONTROLS.get(tokenizer)
    except TypeError:  # not weakly referable: listed every time
        cached = None
    if cached is not None and cached[0] == state:  # listing them costs about 1 ms for a tokenizer with 250 of them
        return cached[1]
    texts = dict.fromkeys(str(t) for t in tokenizer.all_special_tokens)
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if token.special:
            texts[token.content] = None
    texts = [t for t in texts if t]
    try:
        _CONTROLS[tokenizer] = (state, texts)
    except TypeError:
        pass
    return texts


def control_ids(tokenizer) -> dict[int, str]:
    """The ids of `control_tokens`, with their texts."""
    ids = {}
    for text in control_tokens(tokenizer):
        i = tokenizer.convert_tokens_to_ids(text)
        if isinstance(i, int) and i >= 0:
            ids.setdefault(i, text)
    return ids


def _normalized(tokenizer, text: str) -> str:
    """`text` after the tokenizer's own normaliser (itself when it has none)."""
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    return normalizer.normalize_str(text) if normalizer is not None else text


def control_spans(tokenizer, texts: list[str]) -> list[list[tuple[int | None, int | None, str]]]:
    """THE special-token rule: per text, the control tokens the tokenizer reads in it, (start, end, token text), found
    by encoding the text itself (add_special_tokens=False) and looking for control ids, so the tokenizer's own
    normalisation, pre-tokenisation and added-token matching decide, never a comparison of raw strings. start/end:
    the characters of `text` the token came from (None where the tokenizer gives no offsets). An unknown character
    read as the unk token is vocabulary, not control text: the unk id counts only where its characters are the unk
    token's text (after normalisation)."""
    if not texts:
        return []
    controls = control_ids(tokenizer)
    unk = getattr(tokenizer, "unk_token_id", None)
    offsets = bool(getattr(tokenizer, "is_fast", False))
    encoded = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=offsets)
    out = []
    for n, text in enumerate(texts):
        spans, cursor = [], 0
        for k, i in enumerate(encoded["input_ids"][n]):
            token = controls.get(i)
            if token is None:
                continue
            start, end = encoded["offset_mapping"][n][k] if offsets else (None, None)
            if i == unk and (start is None or _normalized(tokenizer, text[start:end]) != _normalized(tokenizer, token)):
                continue
            if start is None and text.find(token, cursor) >= 0:  # no offsets: the raw text's next occurrence
                start = text.find(token, cursor)
                end = cursor = start + len(token)
            spans.append((start, end, token))
        out.append(spans)
    return out


def refuse_control_text(row: dict, tokenizer) -> None:
    """Data text is data: a special token's text inside a row would be read as that control token (an EOS in a
    completion would end it there). The tokenizer cannot be told which parts of a rendered chat template are the
    template's own tokens and which are message text, so such a row is refused, naming the field and the token. What
    counts is what the tokenizer reads in each data string alone (`control_spans`: its ids, after its normalisation),
    so text that becomes a control token only once normalised (a fullwidth '＜/s＞' under NFKC) is refused too."""
    texts = [(where, text) for key in ("prompt", "chosen", "rejected", "tools", "chat_template_kwargs")
             for where, text in _data_texts(row.get(key), f"'{key}'")]
    for (where, text), spans in zip(texts, control_spans(tokenizer, [t for _, t in texts])):
        if spans:
            start, end, token = spans[0]
            source = text[start:end] if start is not None else token
            read = "" if source == token else f" (which the tokenizer reads as {token!r})"
            at = f", at character {start}" if start is not None else ""
            raise BadRowError(
                "special_token_text",
                f"{where} contains {source!r}{read}, the text of the tokenizer's special token (id "
                f"{tokenizer.convert_tokens_to_ids(token)}){at}; data text is never read as control tokens: remove it "
                "(refcache ends every completion with EOS itself)")


def _refuse_formed_controls(text: str, data: list[tuple[str, str]], tokenizer) -> None:
    """No control token may be formed across the edge of message text in the rendered template (text "<|us" in one
    message and "er|>" in the next): each (where, message string) of `data` found in `text` must not partly overlap a
    control token the tokenizer reads in `text` (control_spans). (An occurrence wholly inside a control token's text
    is a coincidence, not the message.)"""
    spans = [(a, b, token) for a, b, token in control_spans(tokenizer, [text])[0] if a is not None]
    if not spans:
        return
    for where, value in data:
        value = value.strip()  # as templates that trim message text render it
        start = text.find(value) if value else -1
        while start >= 0:
            end = start + len(value)
            for a, b, token in spans:
                if a < end and start < b and not (a <= start and end <= b):
                    raise BadRowError("special_token_text", f"{where} and the text next to it in the rendered chat "
                                                            f"template form {token!r}, the text of the tokenizer's "
                                                            "special token; data text is never read as control tokens")
            start = text.find(value, start + 1)


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


# ---------------------------------------------------------------------------------------------------------------
# tokenization


def _template_inputs(row: dict, tokenizer) -> dict:
    """What the row gives the chat template besides its messages, as TRL reads it: `tools` (a list of tool schemas,
    or that list as a JSON string) and `chat_template_kwargs` (a mapping of template variables)."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise BadRowError("bad_type", f"'tools' is a string but not JSON ({e})") from None
    if tools is not None and not isinstance(tools, list):
        raise BadRowError("bad_type", f"'tools' is {type(tools).__name__}; expected a list of tool schemas")
    _check_value(tools, "'tools'")
    kwargs = row.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRowError("bad_type", f"'chat_template_kwargs' is {type(kwargs).__name__}; expected a mapping")
    _check_value(kwargs, "'chat_template_kwargs'")
    kwargs = {k: v for k, v in (kwargs or {}).items() if v is not None}
    if kwargs:
        import inspect

        reserved = set(inspect.signature(tokenizer.apply_chat_template).parameters) & set(kwargs)
        if reserved:
            raise BadRowError("bad_type", f"'chat_template_kwargs' sets {sorted(reserved)}, which are arguments of "
                                          "apply_chat_template, not template variables")
    return {**({"tools": tools} if tools else {}), **kwargs}


def _uses_template(conversational: bool, config: EncodingConfig) -> bool:
    return config.chat_template == "on" or (config.chat_template == "auto" and conversational)


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used at all (it is not valid Jinja): an error for the whole job."""


def _apply_template(tokenizer, messages: list[dict], inputs: dict, **kwargs) -> str:
    """The template's text for `messages`. A template that fails on this row (its own raise_exception, a sandbox
    violation, an error on these values) makes a bad row; one that does not compile fails the job."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **inputs, **kwargs)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"the chat template of the tokenizer {getattr(tokenizer, 'name_or_path', '') or '(in memory)'} is not "
            f"valid Jinja (line {e.lineno}: {e.message}); fix chat_template.jinja / tokenizer_config.json in the "
            "model folder") from None
    except Exception as e:
        raise BadRowError("template_error", f"the chat template failed on this row ({type(e).__name__}: "
                                            f"{str(e).splitlines()[0][:300] if str(e) else 'no message'})") from None


def _empty(value) -> bool:
    return value is None or (isinstance(value, (str, list, dict)) and not value)


def _check_rendered(tokenizer, prompt: list[dict], completion: list[dict], inputs, full_text: str, field_of) -> None:
    """Every non-empty message field besides role/content, and the row's tools, must change what the template
    renders: a field the template leaves out would be dropped silently. (chat_template_kwargs are settings, which
    may well equal the template's defaults: they are passed, not checked.)"""
    conversation = prompt + completion
    for i, m in enumerate(conversation):
        for key in m:
            if key in ("role", "content") or _empty(m[key]):
                continue
            without = [*conversation[:i], {k: v for k, v in m.items() if k != key}, *conversation[i + 1 :]]
            try:
                dropped = _apply_template(tokenizer, without, inputs) == full_text
            except BadRowError:  # the template needs the field (it fails without it): it is used
                dropped = False
            if dropped:
                raise BadRowError("field_not_rendered", f"{field_of(i)}.{key} is not rendered by the chat template, "
                                                        "so it would be dropped; remove it or use a template that "
                                                        "renders it")
    if "tools" in inputs and _apply_template(tokenizer, conversation, {k: v for k, v in inputs.items()
                                                                      if k != "tools"}) == full_text:
        raise BadRowError("field_not_rendered", "'tools' is not rendered by the chat template, so it would be "
                                                "dropped; remove it or use a template that renders it")


def _render(tokenizer, prompt, completion, conversational: bool, config: EncodingConfig, inputs: dict,
            side: str = "chosen", implicit: bool = False) -> tuple[str, str]:
    """Return (prompt_text, completion_text) with the chat template applied where the config says so."""
    use_template = _uses_template(conversational, config)
    if conversational and not use_template:
        raise BadRowError("needs_chat_template", "conversational row but the encoding config has chat_template=off")
    if not use_template:
        if inputs:
            what = "'tools'" if "tools" in inputs else "'chat_template_kwargs'"
            raise BadRowError("field_not_rendered", f"{what} is given but the row is not rendered with a chat "
                                                    "template, so it would be dropped")
        return prompt, completion
    if not getattr(tokenizer, "chat_template", None):
        raise BadRowError("needs_chat_template", "the tokenizer has no chat template for a conversational row")
    if not conversational:
        prompt = [{"role": "user", "content": prompt}]
        completion = [{"role": "assistant", "content": completion}]

    def field_of(i):  # the row's field of conversation message i (an implicit prompt is the completions' first ones)
        if not conversational:
            return "'prompt'" if i == 0 else f"'{side}'"
        return f"'{side}'[{i}]" if implicit else f"'prompt'[{i}]" if i < len(prompt) else f"'{side}'[{i - len(prompt)}]"

    prompt_text = _apply_template(tokenizer, prompt, inputs, add_generation_prompt=True)
    full_text = _apply_template(tokenizer, prompt + completion, inputs)
    _check_rendered(tokenizer, prompt, completion, inputs, full_text, field_of)
    conversation = prompt + completion
    data = [[text for text in (_data_texts({k: v for k, v in m.items() if k != "role"}, field_of(i)) if conversational
                                else [(field_of(i), m["content"])])] for i, m in enumerate(conversation)]
    _refuse_formed_controls(full_text, [text for texts in data for text in texts], tokenizer)
    if not full_text.startswith(prompt_text):
        raise BadRowError(
            "template_not_prefix",
            "the chat template renders the prompt differently once the completion is appended",
        )
    completion_text = full_text[len(prompt_text) :]
    eos = tokenizer.eos_token
    if eos and eos in completion_text and config.completion_end == "eos":  # kept through its final EOS only
        last = completion_text.rindex(eos)
        before, after = completion_text[:last], completion_text[last + len(eos) :]
        for where, value in (text for texts in data[len(prompt) :] for text in texts):
            value = value.strip()
            if value and value in after and value not in before:  # (also before it: rendered where it is kept)
                raise BadRowError("text_after_eos", f"the chat template renders {where} after the completion's "
                                                    f"final EOS {eos!r}, where nothing is kept")
    return prompt_text, completion_text


def _tokenize(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer itself puts before a text (`tokenizer(text)` with its default
    add_special_tokens=True): [bos] for Llama-style tokenizers, [] for GPT-2/Pythia-style ones."""
    probe = "a"
    plain = _tokenize(tokenizer, probe)
    full = list(tokenizer(probe)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


def _bos_prefix(tokenizer, prompt_ids: list[int], templated: bool, config: EncodingConfig) -> list[int]:
    """What goes before the prompt's own tokens (see BOS_MODES)."""
    bos = tokenizer.bos_token_id
    if config.add_bos is True:  # as every cache made before the "tokenizer" rule
        return [bos] if bos is not None and prompt_ids[:1] != [bos] else []
    if config.add_bos is False or templated:  # a template renders its own BOS, or none
        return []
    prefix = special_prefix(tokenizer)
    return [] if prefix and prompt_ids[: len(prefix)] == prefix else prefix


def _finish_completion(ids: list[int], eos_id, config: EncodingConfig, templated: bool) -> list[int]:
    if templated and config.completion_end == "template":  # the template's text as it is (TRL adds no EOS to it)
        return ids
    if eos_id is not None and eos_id in ids:
        last = len(ids) - 1 - ids[::-1].index(eos_id)
        ids = ids[: last + 1]  # template text after the final EOS (e.g. a newline) is not scored
    elif config.add_eos and eos_id is not None:
        ids = ids + [eos_id]
    return ids


def encode_pair(row: dict, tokenizer, config: EncodingConfig) -> EncodedPair:
    """Encode one preference row. Raises BadRowError with a stable reason for rows that cannot be used."""
    prompt, chosen, rejected, conversational = parse_row(row)
    refuse_control_text(row, tokenizer)
    inputs = _template_inputs(row, tokenizer)
    implicit = "prompt" not in row
    p_text, c_text = _render(tokenizer, prompt, chosen, conversational, config, inputs, "chosen", implicit)
    p_text_r, r_text = _render(tokenizer, prompt, rejected, conversational, config, inputs, "rejected", implicit)
    if p_text != p_text_r:
        raise BadRowError("template_not_prefix", "the chat template renders the prompt differently before the "
                                                 "chosen and the rejected completion")
    prompt_ids = _tokenize(tokenizer, p_text)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    templated = _uses_template(conversational, config)
    prompt_ids = _bos_prefix(tokenizer, prompt_ids, templated, config) + prompt_ids
    chosen_ids = _finish_completion(_tokenize(tokenizer, c_text), eos, config, templated)
    rejected_ids = _finish_completion(_tokenize(tokenizer, r_text), eos, config, templated)
    if not prompt_ids:
        raise BadRowError("empty_prompt", "the prompt encodes to no tokens; nothing to condition the completion on")
    for name, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        if not ids:
            raise BadRowError("empty_completion", f"'{name}' completion encodes to no tokens")
    return _truncate(prompt_ids, chosen_ids, rejected_ids, config, bos)


def _truncate(prompt_ids, chosen_ids, rejected_ids, config: EncodingConfig, bos) -> EncodedPair:
    limit = config.max_length
    longest = max(len(chosen_ids), len(rejected_ids))
    if len(prompt_ids) + longest <= limit:
        return EncodedPair(prompt_ids, chosen_ids, rejected_ids)
    if config.truncation_mode == "error":
        raise BadRowError(
            "too_long", f"prompt {len(prompt_ids)} + completion {longest} tokens exceed max_length {limit}"
        )
    if config.truncation_mode == "keep_start":
        if len(prompt_ids) >= limit:
            raise BadRowError(
                "prompt_too_long",
                f"prompt has {len(prompt_ids)} tokens, leaving no room for a completion within max_length {limit}",
            )
        room = limit - len(prompt_ids)
        return EncodedPair(prompt_ids, chosen_ids[:room], rejected_ids[:room])
    # keep_end: keep completions whole and drop the oldest prompt tokens (BOS stays first when present).
    room = limit - longest
    keep_bos = 1 if bos is not None and prompt_ids[0] == bos else 0
    if room < 1 or room - keep_bos < 1:
        raise BadRowError(
            "completion_too_long", f"a completion of {longest} tokens leaves no room for the prompt in {limit}"
        )
    tail = prompt_ids[len(prompt_ids) - (room - keep_bos) :]
    return EncodedPair(prompt_ids[:keep_bos] + tail, chosen_ids, rejected_ids)
