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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

TRUNCATION_MODES = ("keep_start", "keep_end", "error")
# "tokenizer": follow the tokenizer's own special tokens for plain text and the template for templated text.
# True / False: always / never prepend BOS (True is what every cache written before the "tokenizer" rule records).
BOS_MODES = ("tokenizer", True, False)
CHAT_TEMPLATE_MODES = ("auto", "on", "off")
ROLES = ("system", "user", "assistant", "tool")


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
        "help": "Maximum prompt + completion tokens per sequence.", "min": 2})
    truncation_mode: str = dataclasses.field(default="keep_start", metadata={
        "choices": TRUNCATION_MODES, "help": "Over-long pairs: keep_start cuts completion ends, keep_end cuts the "
                                             "prompt start, error rejects the row."})
    chat_template: str = dataclasses.field(default="auto", metadata={
        "choices": CHAT_TEMPLATE_MODES, "help": "Apply the tokenizer's chat template: auto (conversational rows "
                                                "only), on (also wrap plain strings), off."})
    # one of BOS_MODES (see the module docstring); not an option: "tokenizer" is what the SFT model saw
    add_bos: bool | str = dataclasses.field(default="tokenizer", metadata={"cli": False})
    add_eos: bool = dataclasses.field(default=True, metadata={"cli": False})  # end completions with EOS

    def __post_init__(self):
        if self.max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {self.max_length}")
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, got {self.truncation_mode!r}")
        if self.chat_template not in CHAT_TEMPLATE_MODES:
            raise ValueError(f"chat_template must be one of {CHAT_TEMPLATE_MODES}, got {self.chat_template!r}")
        if not any(self.add_bos is m or self.add_bos == m and isinstance(m, str) for m in BOS_MODES):
            raise ValueError(f"add_bos must be 'tokenizer', true or false, got {self.add_bos!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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

    @property
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


def _check_messages(value: Any, field: str) -> list[dict]:
    if not value:
        raise BadRowError("empty_field", f"'{field}' is an empty message list")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise BadRowError("bad_message", f"'{field}'[{i}] is not a {{'role', 'content'}} message")
        if m["role"] not in ROLES:
            raise BadRowError("bad_role", f"'{field}'[{i}] has role {m['role']!r}; expected one of {ROLES}")
        if not isinstance(m["content"], str):
            raise BadRowError("bad_type", f"'{field}'[{i}].content is {type(m['content']).__name__}, not text")
        _text(m["content"], f"'{field}'[{i}].content")
    return [{"role": m["role"], "content": m["content"]} for m in value]


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


def _uses_template(conversational: bool, config: EncodingConfig) -> bool:
    return config.chat_template == "on" or (config.chat_template == "auto" and conversational)


def _render(tokenizer, prompt, completion, conversational: bool, config: EncodingConfig) -> tuple[str, str]:
    """Return (prompt_text, completion_text) with the chat template applied where the config says so."""
    use_template = _uses_template(conversational, config)
    if conversational and not use_template:
        raise BadRowError("needs_chat_template", "conversational row but the encoding config has chat_template=off")
    if not use_template:
        return prompt, completion
    if not getattr(tokenizer, "chat_template", None):
        raise BadRowError("needs_chat_template", "the tokenizer has no chat template for a conversational row")
    if not conversational:
        prompt = [{"role": "user", "content": prompt}]
        completion = [{"role": "assistant", "content": completion}]
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    if not full_text.startswith(prompt_text):
        raise BadRowError(
            "template_not_prefix",
            "the chat template renders the prompt differently once the completion is appended",
        )
    return prompt_text, full_text[len(prompt_text) :]


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


def _finish_completion(ids: list[int], eos_id, config: EncodingConfig) -> list[int]:
    if eos_id is not None and eos_id in ids:
        last = len(ids) - 1 - ids[::-1].index(eos_id)
        ids = ids[: last + 1]  # template text after the final EOS (e.g. a newline) is not scored
    elif config.add_eos and eos_id is not None:
        ids = ids + [eos_id]
    return ids


def encode_pair(row: dict, tokenizer, config: EncodingConfig) -> EncodedPair:
    """Encode one preference row. Raises BadRowError with a stable reason for rows that cannot be used."""
    prompt, chosen, rejected, conversational = parse_row(row)
    p_text, c_text = _render(tokenizer, prompt, chosen, conversational, config)
    p_text_r, r_text = _render(tokenizer, prompt, rejected, conversational, config)
    assert p_text == p_text_r
    prompt_ids = _tokenize(tokenizer, p_text)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    prompt_ids = _bos_prefix(tokenizer, prompt_ids, _uses_template(conversational, config), config) + prompt_ids
    chosen_ids = _finish_completion(_tokenize(tokenizer, c_text), eos, config)
    rejected_ids = _finish_completion(_tokenize(tokenizer, r_text), eos, config)
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
