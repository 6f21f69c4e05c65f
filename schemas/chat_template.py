"""Calls of the tokenizer's chat template for a row (schemas/encoding.py renders the prompt and completions through
them): what the row gives the template besides its messages, a template that fails on a row (a bad row) or at all (the
job's error), and the check that every field a row carries is rendered, never dropped."""

from __future__ import annotations

import json

from .rows import BadRowError, _check_value


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
