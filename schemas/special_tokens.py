"""The special-token rule: data text is never read as a control token. What counts is what the tokenizer itself reads
in a string (its ids, after its own normalisation), so a row whose text the tokenizer reads as a special token, or
whose message texts form one across their edges in the rendered chat template, is refused (schemas/encoding.py)."""

from __future__ import annotations

import weakref

from .rows import BadRowError, _data_texts


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
