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

The row's fields are checked and read in `rows.py`, the special-token rule is `special_tokens.py`, the chat
template's calls are `chat_template.py`; the config, the rendering and the tokenization are here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass

from .chat_template import ChatTemplateError, _apply_template, _check_rendered, _template_inputs  # noqa: F401  (ChatTemplateError: re-exported for the tests)
from .rows import ROLES, BadRowError, _data_texts, _text, parse_row  # noqa: F401  (ROLES: re-exported for the tests)
from .special_tokens import _refuse_formed_controls, refuse_control_text

TRUNCATION_MODES = ("keep_start", "keep_end", "error")
# "tokenizer": follow the tokenizer's own special tokens for plain text and the template for templated text.
# True / False: always / never prepend BOS (True is what every cache written before the "tokenizer" rule records).
BOS_MODES = ("tokenizer", True, False)
CHAT_TEMPLATE_MODES = ("auto", "on", "off")
# where a chat-templated completion ends: at its final EOS (refcache's own), or where the template's text ends (TRL's
# DPOTrainer, which scores whatever the template writes after the EOS, e.g. a newline)
COMPLETION_END_MODES = ("eos", "template")
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
        for fld in dataclasses.fields(cls):  # first: a damaged value is named as such, whatever else is missing
            if fld.name in d and (expected := _unwritten(fld, d[fld.name])) is not None:
                raise RecordedEncodingError(fld.name, d[fld.name], expected)
        if "add_bos" not in d:  # its default changed: a missing value cannot be told apart, so never assume one
            raise ValueError("no add_bos recorded, so the BOS rule the ids were made with is unknown; re-run "
                             "precompute-ref with this version of refcache")
        return cls(**d)


class RecordedEncodingError(ValueError):
    """An encoding record holding a value refcache never writes for that field (a float 1024.0 for max_length, a
    negative length, a mode that is not one): the record is damaged, never coerced into a setting."""

    def __init__(self, key: str, value, expected: str):
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"encoding {key!r} is {value!r}, not a value precompute-ref writes ({expected})")


def _unwritten(fld: dataclasses.Field, value) -> str | None:
    """None where `value` is one EncodingConfig.to_dict writes for field `fld` (its option's domain, the JSON type
    exactly: a bool is not a number, 1024.0 is not 1024), else what the field takes."""
    meta = fld.metadata
    if "domain" in meta:  # every numeric encoding option is a whole number: "count" (>= 1) or "natural" (>= 0)
        least = meta.get("min", 0 if meta["domain"] == "natural" else 1)
        return None if type(value) is int and value >= least else f"a whole number >= {least}"
    if "choices" in meta:
        return None if isinstance(value, str) and value in meta["choices"] else "one of " + ", ".join(meta["choices"])
    if fld.name == "add_eos":
        return None if isinstance(value, bool) else "true or false"
    if fld.name == "add_bos":
        return None if isinstance(value, bool) or value == "tokenizer" else "tokenizer, true or false"
    if fld.name == "columns":
        return None if value is None or isinstance(value, str) else "TARGET=COLUMN,... text"
    return None


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


# ---------------------------------------------------------------------------------------------------------------
# tokenization


def _uses_template(conversational: bool, config: EncodingConfig) -> bool:
    return config.chat_template == "on" or (config.chat_template == "auto" and conversational)


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
