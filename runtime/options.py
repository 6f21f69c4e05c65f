"""Options generated from config dataclasses: a field is an option (both spellings, TRL's aliases), its metadata the
help text, its section in --help, its choices, its domain or its location; the encoding options every command that
encodes data shares."""

from __future__ import annotations

import dataclasses
import re
import typing

import click

from schemas.encoding import EncodingConfig

from .domains import DomainType, domain_type
from .locations import Location, location_type


# TRL's names for our options (`trl dpo`'s ScriptArguments / ModelConfig fields): the one table of them, for every
# command (precompute-ref and train-dpo take the same spellings) and train-dpo's --config keys alike
# (--model_name_or_path is --model); a command takes those whose field it has.
TRL_ALIASES = {"model_name_or_path": "model", "dataset_name": "data", "dataset_train_split": "split",
               "dataset_test_split": "eval_split", "dtype": "model_dtype"}
# TRL's (TrainingArguments') names for the opposite of one of our flags: `--disable-tqdm` is precompute-ref's
# --no-progress (train-dpo takes TrainingArguments' own disable_tqdm); `--disable-tqdm false` and a config file's
# `disable_tqdm: true` read as the command line reads them
TRL_NEGATIONS = {"disable_tqdm": "progress"}


def encoding_options(f):
    """Encoding options shared by every command that encodes data (generated from EncodingConfig)."""
    return dataclass_options(EncodingConfig, group="Encoding")(f)


# the encoding options (fields of EncodingConfig that are options), as encoding_options adds them
ENCODING_OPTIONS = tuple(f.name for f in dataclasses.fields(EncodingConfig) if f.metadata.get("cli") is not False)


def encoding_from(**given) -> EncodingConfig:
    """The EncodingConfig of the encoding options given (ENCODING_OPTIONS; None: not given)."""
    return EncodingConfig(**{k: v for k, v in given.items() if v is not None})


def model_hash_text(text) -> str:
    """A model hash given on the command line or in a config file (train-dpo --ref-model-hash), in the one form the
    cache's stamps hold it: 64 lowercase hexadecimal digits (a sha256). A ValueError says what it must be and
    where a cache's value is."""
    value = str(text).strip()
    if re.fullmatch(r"[0-9a-f]{64}", value):
        return value
    from .terminal import escaped

    how = ("in lowercase, as the stamps hold it" if re.fullmatch(r"[0-9a-fA-F]{64}", value) else
           f"{len(value)} characters given" if re.fullmatch(r"[0-9a-fA-F]*", value) else "only the digits 0-9 and a-f")
    raise ValueError(f"{escaped(_clip(value))} is not a model hash: 64 lowercase hexadecimal digits (a sha256; {how}); "
                     "a cache's is stamps.model_hash in CACHE/manifest.json (audit-ref CACHE --json FILE reports it)")


def _clip(value: str, limit: int = 80) -> str:
    return value if len(value) <= limit else value[:limit] + "..."


class ParsedText(click.ParamType):
    """An option whose text a field's `parse` metadata checks and writes in its one form (a ValueError is a usage
    error naming the option)."""

    def __init__(self, parse, metavar: str | None = None):
        self.parse, self.metavar, self.name = parse, metavar, getattr(parse, "__name__", "text")

    def get_metavar(self, param, ctx=None):
        return self.metavar

    def convert(self, value, param, ctx):
        try:
            return self.parse(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class Text(click.ParamType):
    """A free-text option's value (a run name, a split, a hub id): any text but a control character (a newline, an
    ESC), which would carry into messages as a forged line and into written files (the model card's heading)."""

    name = "text"

    def convert(self, value, param, ctx):
        from .terminal import escaped, holds_control

        text = click.STRING.convert(value, param, ctx)
        if holds_control(text):
            self.fail(f"{escaped(text)}: holds a control character; give the text without it", param, ctx)
        return text


TEXT = Text()


def field_help(help: str, group: str | None = None, **extra) -> dict:
    """Metadata for a config field: its --help text, its section in --help, and optionally `choices`,
    `cli=False` (not an option), `required=True`, `show_default` (a text instead of the default's value), `domain`
    (a numeric option's domain: runtime/domains.py; every int or float option declares one), `min` (a bound beyond
    the domain's), `click_type` (a click type that checks more, e.g. click.Path(file_okay=False)), `parse` (text ->
    value, a ValueError for a bad one: a ParsedText option) with its `metavar`, `location` ("input" or "output": a
    path or URL, read by the Location type, with `store`, `words`, `json_text`; every path option declares one)."""
    return {"help": help, "group": group, **extra}


class GroupedOption(click.Option):
    def __init__(self, *args, group: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group


def click_type(tp) -> tuple[object, bool]:
    """(click type, multiple) for a dataclass field's type: Optional[X] is X, Literal and Enum are choices, list[X]
    is a repeatable option, anything mixed (Union[dict, str], ...) is passed through as text for the dataclass to
    parse, as transformers' own argument parser does."""
    import enum
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return click_type(rest[0]) if len(rest) == 1 else (str, False)
    if origin is typing.Literal:
        return click.Choice([str(a) for a in args]), False
    if origin in (list, tuple):
        inner = click_type(args[0])[0] if args else str
        return (inner if inner in (int, float, str) or isinstance(inner, click.Choice) else str), True
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return click.Choice([str(e.value) for e in tp]), False
    return (tp if tp in (bool, int, float, str) else str), False


def _default_text(fld: dataclasses.Field) -> str | None:
    if "show_default" in fld.metadata:
        return fld.metadata["show_default"]
    if fld.default is not dataclasses.MISSING:
        value = fld.default
    elif fld.default_factory is not dataclasses.MISSING:
        value = fld.default_factory()
    else:
        return None
    value = getattr(value, "value", value)  # enums
    return None if value in (None, "", [], {}) else str(value)


def _help_text(fld: dataclasses.Field) -> str:
    # argparse-style help (transformers' fields) escapes % as %%; click prints help as written
    text = " ".join(str(fld.metadata.get("help") or "").replace("%%", "%").split()) or f"See {fld.name}."
    default = _default_text(fld)
    return text + (f" [default: {default}]" if default is not None and not fld.metadata.get("required") else "")


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """One generated option as plain data: what click needs to parse and document it. A field of a foreign dataclass
    (transformers.TrainingArguments) has a plain kind (bool, int, float, str or a list of choices), so its spec can be
    stored as JSON (`to_json` / `from_json`) and the option built without importing the class (dpo/trainer_options.py)."""

    name: str
    decls: tuple[str, ...]
    kind: object  # a click type, or one of bool, int, float, str
    multiple: bool
    help: str
    group: str | None
    required: bool

    def to_json(self) -> dict:
        kind = self.kind
        if isinstance(kind, DomainType):
            kind = {"domain": kind.domain, "min": kind.minimum}
        elif isinstance(kind, click.Choice):
            kind = {"choices": list(kind.choices)}
        elif isinstance(kind, Location) and kind.local is None:
            kind = {"location": kind.role, "store": kind.store, "words": list(kind.words), "json_text": kind.json_text}
        elif kind in (bool, int, float, str):
            kind = kind.__name__
        else:
            raise TypeError(f"option {self.name}: a {type(kind).__name__} cannot be stored")
        return {"name": self.name, "decls": list(self.decls), "kind": kind, "multiple": self.multiple, "help": self.help,
                "group": self.group, "required": self.required}

    @classmethod
    def from_json(cls, data: dict) -> "OptionSpec":
        kind = data["kind"]
        if isinstance(kind, dict) and "location" in kind:
            kind = location_type(kind)
        elif isinstance(kind, dict) and "domain" in kind:
            kind = domain_type(kind["domain"], kind.get("min"))
        elif isinstance(kind, dict):
            kind = click.Choice(kind["choices"])
        else:
            kind = {"bool": bool, "int": int, "float": float, "str": str}[kind]
        return cls(**{**data, "decls": tuple(data["decls"]), "kind": kind})


def field_domain(fld: dataclasses.Field, kind, domains=None) -> str | None:
    """The declared domain of a numeric field (`kind` int or float): its `domain` metadata, else `domains`' entry
    (the table of a foreign class, e.g. TrainingArguments'). None for a field that is not a number. A number of
    our own without a domain is an error where the option is made; a foreign one not in its table is taken as any
    finite number (NaN and infinities are never a value)."""
    if kind not in (int, float):
        return None
    declared = fld.metadata.get("domain") or (domains or {}).get(fld.name)
    if declared:
        return declared
    if domains is None:
        raise TypeError(f"option {fld.name}: a number without a declared domain; add metadata domain=... (one of "
                        f"runtime.domains.DOMAINS)")
    return "integer" if kind is int else "finite"


def option_specs(cls, *, group: str | None = None, skip=(), enforce_required=True, aliases=None, negations=None,
                 locations=None, domains=None) -> list[OptionSpec]:
    """One OptionSpec per init field of dataclass `cls`, in field order, in both spellings (--learning-rate and
    --learning_rate), default None so that only given values are collected (the dataclass keeps its defaults).
    enforce_required=False: required fields are checked by the caller, e.g. after merging a config file.
    `aliases`: {other name: field name}, more names of a field's option (both spellings of each); `negations`: {other
    name: boolean field name}, names that turn the flag off (--disable-tqdm for --no-progress). `locations`:
    {field name: `location` metadata} for the path fields of a dataclass that is not ours (TrainingArguments). A
    numeric field's type checks its domain (field_domain; `domains`: {field name: domain} for a class whose fields
    we do not write)."""
    names_of: dict[str, list[str]] = {}
    for alias, name in (aliases or {}).items():
        names_of.setdefault(name, []).append(alias)
    hints = typing.get_type_hints(cls)
    specs = []
    for fld in dataclasses.fields(cls):
        if not fld.init or fld.name in skip or fld.metadata.get("cli") is False:
            continue
        kind, multiple = click_type(hints[fld.name])
        if "choices" in fld.metadata:
            kind = click.Choice([str(c) for c in fld.metadata["choices"]])
        if "click_type" in fld.metadata:
            kind = fld.metadata["click_type"]
        if "parse" in fld.metadata:
            kind = ParsedText(fld.metadata["parse"], fld.metadata.get("metavar"))
        if "location" in fld.metadata or fld.name in (locations or {}):
            kind = location_type({**fld.metadata, **(locations or {}).get(fld.name, {})})
        domain = field_domain(fld, kind, domains)
        if domain is not None:
            kind = domain_type(domain, fld.metadata.get("min"))
        kebab, snake = "--" + fld.name.replace("_", "-"), "--" + fld.name
        others = [d for a in names_of.get(fld.name, []) for d in dict.fromkeys(("--" + a.replace("_", "-"),
                                                                                 "--" + a))]
        where = fld.metadata.get("group", group) if "group" in fld.metadata else group
        text = _help_text(fld) + (" [required]" if fld.metadata.get("required") and not enforce_required else "")
        required = bool(fld.metadata.get("required")) and enforce_required
        if kind is bool:
            decls = [f"{kebab}/--no-{kebab[2:]}"] + ([f"{snake}/--no_{snake[2:]}"] if snake != kebab else [])
            decls += [f"{d}/--no-{d[2:]}" for d in others]
            for off in [a for a, name in (negations or {}).items() if name == fld.name]:
                decls += list(dict.fromkeys((f"--no-{off.replace('_', '-')}/--{off.replace('_', '-')}",
                                             f"--no_{off}/--{off}")))
        else:
            decls = [kebab] + ([snake] if snake != kebab else []) + others
        specs.append(OptionSpec(fld.name, tuple(decls), kind, multiple, text, where, required))
    return specs


def spec_options(specs: list[OptionSpec]):
    """A decorator adding one click option per spec, in the specs' order."""

    def decorate(f):
        for spec in reversed(specs):
            # default None only where not required: click (8.5) takes an explicit None default as a given value
            common = {"help": spec.help, "group": spec.group, "cls": GroupedOption, "required": spec.required,
                      **({} if spec.required else {"default": None})}
            if spec.kind is bool:
                f = click.option(*spec.decls, spec.name, **common)(f)
            else:
                f = click.option(*spec.decls, spec.name, type=TEXT if spec.kind is str else spec.kind,
                                 multiple=spec.multiple, **common)(f)
        return f

    return decorate


def dataclass_options(cls, *, group: str | None = None, skip=(), enforce_required=True, aliases=None, negations=None,
                      locations=None, domains=None):
    """A decorator adding one click option per init field of dataclass `cls` (option_specs)."""
    return spec_options(option_specs(cls, group=group, skip=skip, enforce_required=enforce_required, aliases=aliases,
                                     negations=negations, locations=locations, domains=domains))

