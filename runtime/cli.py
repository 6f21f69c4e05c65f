"""The command-line frame the three commands share (precompute-ref, train-dpo, audit-ref): errors as one paragraph and
an exit code, quiet libraries, encoding options."""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
import typing
from pathlib import Path

import click

from schemas.encoding import EncodingConfig

from .domains import DomainType, domain_type
from .terminal import escaped

# Every command's exit codes: 0 done (audit-ref: every check passed), 1 failed (a check failed, an unexpected error),
# 2 refused (bad input, a cache or output folder that does not match, a usage error), 3 (train-dpo) stopped because
# the loss, the gradient norm or the weights became non-finite (runtime.errors.NonFiniteError), 130 interrupted.
EXIT_OK, EXIT_FAILED, EXIT_REFUSED, EXIT_NON_FINITE = 0, 1, 2, 3


def run_cli(body, debug: bool, next_step=None, writes_to=None) -> None:
    """Run a command body, turning the errors users can act on into one paragraph and exit code 2. `next_step`: the
    command's own advice after an interruption or a full disk, `() -> str` (default: precompute-ref's, where the same
    command resumes); `writes_to`: `() -> folder or None`, where the command writes (named when the disk is full)."""
    from storage.files import UnsafeDestination
    from schemas.format import CacheError
    from schemas.stamps import WeightsError
    from storage.faults import StoreUnavailable

    from .data import DataError
    from .disk import NoSpaceError, is_no_space, no_space_error
    from .errors import JobError
    from .terminal import echo, printable

    def carry_on() -> str:
        if next_step is None:
            return "re-run the same command to resume"
        try:
            return next_step()
        except Exception as e:  # the advice must not hide what happened
            return f"(no advice: {type(e).__name__}: {e})"

    try:
        try:
            body()
        except (DataError, JobError, CacheError, WeightsError, UnsafeDestination, StoreUnavailable, click.UsageError,
                KeyboardInterrupt):
            raise
        except Exception as e:
            folder = _writes_to(writes_to)
            if not is_no_space(e, folder):
                raise
            raise no_space_error(e, folder) from e  # a save no one wrapped in runtime.disk.writing
    except (DataError, JobError, CacheError, WeightsError, UnsafeDestination, StoreUnavailable, click.UsageError) as e:
        if debug:
            traceback.print_exc()
        if isinstance(e, click.UsageError):  # click prints it: its text through the same rule
            e.message = printable(e.message)
            raise
        # messages are built in many places from data (ids, row text, paths, keys): the whole text is made
        # printable here (runtime/terminal.py), keeping only the newlines the message lays out
        echo(f"error: {e}" + (f"\n  then: {carry_on()}" if isinstance(e, NoSpaceError) else ""), err=True)
        sys.exit(getattr(e, "exit_code", EXIT_REFUSED))  # NonFiniteError: EXIT_NON_FINITE; KLAlarmStop: EXIT_KL_ALARM
    except KeyboardInterrupt:
        echo(f"interrupted; {carry_on()}", err=True)
        sys.exit(130)
    except ImportError as e:  # an option that needs a package this environment lacks (--use-liger-kernel, ...)
        if debug:
            traceback.print_exc()
        echo(printable(f"error: a package this run needs is not installed: {e}\n  remedy: install it in this "
                       "environment (pip install ...), or leave out the option that asks for it"), err=True)
        sys.exit(EXIT_REFUSED)
    except Exception as e:
        if debug:
            traceback.print_exc()
        else:
            echo(f"error: unexpected {type(e).__name__}: {e} (re-run with --debug for the traceback)", err=True)
        sys.exit(EXIT_FAILED)


def _writes_to(writes_to):
    """The folder a command writes to, or None (not known, or its advice failed: the error at hand matters more)."""
    try:
        return writes_to() if writes_to else None
    except Exception:
        return None


def exit_without_teardown(command) -> None:
    """Run a click command as the whole process, then leave without the interpreter's module teardown (about 1-2 s
    of CPU after torch, transformers and datasets are imported, in every run). Everything that would run at a normal
    exit and can matter still runs first: the atexit handlers (logging, trackers, temp files), a garbage collection
    (finalizers of unreachable objects) and the flush of stdout and stderr. Full garbage collections wait until the
    command says its long-lived objects are made (`heap_settled`). Only for a process's entry point: in any other
    caller (a test's CliRunner, a notebook) call the command itself."""
    import atexit
    import gc

    _postpone_full_collections()
    try:
        command()  # click's standalone mode ends with SystemExit
        code = 0
    except SystemExit as e:
        code = e.code
    if isinstance(code, str):  # SystemExit("message"): printed to stderr, exit status 1
        from .terminal import echo

        echo(code, err=True)
        code = 1
    code = 0 if code is None else code
    atexit._run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing left to write
            pass
    os._exit(code)


# The thresholds of the garbage collector while a process's start-up postpones its full collections (None: not
# postponed, e.g. a test calling a command in its own process).
_POSTPONED: dict = {"thresholds": None}


def _postpone_full_collections() -> None:
    """Importing torch, transformers and datasets makes about half a million objects that live as long as the process
    and almost no garbage; each full collection on the way walks all of them again (8 in a train-dpo run, with the
    one at exit 0.9 s of CPU on a busy 2-core machine, finding a few hundred garbage objects). The young generations
    are still collected as usual: that is where the garbage is."""
    import gc

    _POSTPONED["thresholds"] = gc.get_threshold()
    young, middle, _old = _POSTPONED["thresholds"]
    gc.set_threshold(young, middle, 2**31 - 1)


def heap_settled() -> None:
    """Called by a command once its libraries are imported and its long-lived objects made (the model loaded, the
    Trainer built): the young generations are collected, what is alive then is moved out of the collector's reach
    (gc.freeze) and full collections resume at the usual thresholds, over the objects made from then on (so they,
    and the collection at exit, walk tens of thousands of objects instead of half a million). Cyclic garbage already
    in the old generation then (a few hundred objects in a train-dpo run), and frozen objects that become unreachable
    later, are not collected before the process ends. A no-op unless the process runs the command through
    exit_without_teardown."""
    import gc

    thresholds = _POSTPONED["thresholds"]
    if thresholds is None:
        return
    _POSTPONED["thresholds"] = None
    gc.collect(1)
    gc.freeze()
    gc.set_threshold(*thresholds)


def quiet_libraries() -> None:
    """Our own progress bar and summary replace the libraries' per-file bars and notices."""
    import logging

    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)  # --device-map: precompute-ref prints the layout itself


# TRL's names for our options (`trl dpo`'s ScriptArguments / ModelConfig fields): the one table of them, for every
# command (precompute-ref and train-dpo take the same spellings) and train-dpo's --config keys alike
# (--model_name_or_path is --model); a command takes those whose field it has.
TRL_ALIASES = {"model_name_or_path": "model", "dataset_name": "data", "dataset_train_split": "split",
               "dataset_test_split": "eval_split", "dtype": "model_dtype"}


def encoding_options(f):
    """Encoding options shared by every command that encodes data (generated from EncodingConfig)."""
    return dataclass_options(EncodingConfig, group="Encoding")(f)


# the encoding options (fields of EncodingConfig that are options), as encoding_options adds them
ENCODING_OPTIONS = tuple(f.name for f in dataclasses.fields(EncodingConfig) if f.metadata.get("cli") is not False)


def encoding_from(**given) -> EncodingConfig:
    """The EncodingConfig of the encoding options given (ENCODING_OPTIONS; None: not given)."""
    return EncodingConfig(**{k: v for k, v in given.items() if v is not None})


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


class Location(click.ParamType):
    """A path-or-URL option (a field with `location` metadata, the audit's CACHE, train-dpo's --config): its text
    read by the one function that reads places, storage.places.location (a local Path, file:// URLs included, or a
    StorePath), at parse time: a URL it refuses (another host's file://, a protocol chain, another protocol) and a
    store URL where the option takes no store are usage errors (exit 2) naming the option. `role`: "input" or
    "output"; `store`: the option takes a cache on an object store; `local`: a click.Path checking the local path
    (exists, file or folder); `words`: values kept as text (resume_from_checkpoint's `true`); `json_text`: a value
    starting with `{` is JSON text, not a path (DeepSpeed and FSDP configs)."""

    name = "path"

    def __init__(self, role: str, *, store: bool = False, local: click.Path | None = None, words=(),
                 json_text: bool = False):
        if role not in ("input", "output"):
            raise ValueError(f"location role {role!r}: input or output")
        self.role, self.store, self.local, self.words, self.json_text = role, store, local, tuple(words), json_text

    def get_metavar(self, param, ctx=None):
        return ("PATH|URL" if self.store else "PATH") + "".join(f"|{w}" for w in self.words[:1])

    def convert(self, value, param, ctx):
        from storage import places

        if isinstance(value, (places.StorePath, Path)):
            return self._checked(value, param, ctx)
        if isinstance(value, bool) and self.words:  # a config file's `resume_from_checkpoint: true`
            value = str(value).lower()
        if self.json_text and isinstance(value, dict):
            return value
        if not isinstance(value, (str, os.PathLike)):
            self.fail(f"{value!r} is not a path ({type(value).__name__})", param, ctx)
        text = os.fspath(value)
        if text.strip().lower() in self.words or (self.json_text and text.lstrip().startswith("{")):
            return text
        if places.is_remote(text) and not self.store:
            self._no_store(text, param, ctx)
        try:
            place = places.location(text)
        except places.LocationError as e:
            self.fail(str(e), param, ctx)
        return self._checked(place, param, ctx)

    def _checked(self, place, param, ctx):
        from storage import places

        if isinstance(place, places.StorePath):
            if not self.store:
                self._no_store(place, param, ctx)
        elif self.local is not None:  # its own check; a hub id's type gives the local snapshot folder it names
            try:
                return Path(self.local.convert(str(place), param, ctx))
            except click.BadParameter:
                if os.path.lexists(place) or getattr(self.local, "names_misses", False):  # a hub id's type does
                    raise
                from storage.nearby import not_here

                self.fail(f"{escaped(place)}: {escaped(not_here(place))}", param, ctx)  # what is there, the closest
        return place

    def _no_store(self, url, param, ctx):
        self.fail(f"{url}: an object-store URL is taken where refcache writes or reads a cache (precompute-ref --out, "
                  "train-dpo --ref-cache / --eval-ref-cache, audit-ref CACHE), not here; give a local path (and copy "
                  "to or from the store with its own tools)", param, ctx)


def read_locations(config) -> None:
    """Every `location` field of a config dataclass read by the Location type, as the command line reads it (the
    local existence checks are the command line's own): a config made in Python, a config file's values and the
    command line's name the same places. Called by each config's __post_init__."""
    for fld in dataclasses.fields(config):
        value = getattr(config, fld.name)
        if "location" not in fld.metadata or value is None:
            continue
        kind = location_type({k: v for k, v in fld.metadata.items() if k != "click_type"})
        try:
            setattr(config, fld.name, kind.convert(value, None, None))
        except click.BadParameter as e:
            raise click.BadParameter(e.message, param_hint=f"'--{fld.name.replace('_', '-')}'") from None


def location_type(metadata) -> Location:
    """The Location type of a field's `location` metadata ("input" or "output"), with its `store`, `words` and
    `json_text` keys and its `click_type` (a click.Path) as the local check."""
    local = metadata.get("click_type")
    return Location(metadata["location"], store=bool(metadata.get("store")),
                    local=local if isinstance(local, click.Path) else None, words=metadata.get("words", ()),
                    json_text=bool(metadata.get("json_text")))


# ---------------------------------------------------------------------------------------------------------------
# options generated from config dataclasses: a field is an option, its metadata the help text


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


# the words transformers' HfArgumentParser takes after a boolean option (its string_to_bool), case-insensitive
TRUE_WORDS, FALSE_WORDS = frozenset({"true", "t", "yes", "y", "1"}), frozenset({"false", "f", "no", "n", "0"})


def bool_words(params, args: list[str]) -> list[str]:
    """The command line with each boolean option's true/false word folded into the option, as TRL's scripts and docs
    write them for transformers' HfArgumentParser (`--bf16 True`, `--disable-tqdm=false`, `--gradient_checkpointing
    True`): `--x true` is `--x`, `--x false` is `--no-x` (a flag without a --no- form: not given). Every boolean option
    of every command (Command.parse_args); anything after `--` is left as it is."""
    opposite: dict[str, str | None] = {}
    for p in params:
        if isinstance(p, click.Option) and p.is_flag and p.is_bool_flag:
            for on in p.opts:
                opposite[on] = p.secondary_opts[0] if p.secondary_opts else None
            for off in p.secondary_opts:
                opposite[off] = p.opts[0]
    # where the command takes no positional argument, any word after a boolean option is meant as its value
    positional = any(isinstance(p, click.Argument) for p in params)
    out, i = [], 0
    while i < len(args):
        word = args[i]
        if word == "--":
            return out + args[i:]
        flag, eq, value = word.partition("=")
        following = args[i + 1] if i + 1 < len(args) else None
        if flag in opposite and (eq or (following is not None and (following.lower() in TRUE_WORDS | FALSE_WORDS or
                                                                    not (positional or following.startswith("-"))))):
            value = value if eq else args[i + 1]
            if value.lower() not in TRUE_WORDS | FALSE_WORDS:
                raise click.UsageError(f"{flag}{eq or ' '}{value}: a boolean option takes true or false (or no "
                                       "value)")
            i += 1 if eq else 2
            chosen = flag if value.lower() in TRUE_WORDS else opposite[flag]
            out += [chosen] if chosen else []
            continue
        out.append(word)
        i += 1
    return out


class Command(click.Command):
    """Every command's parser: a boolean option may be followed by a true/false word (bool_words), and command-line
    errors (click's own, raised while the options are parsed: a value that is not a choice, a path that does not
    exist) print their text by the terminal rule too (runtime/terminal.py)."""

    def parse_args(self, ctx, args):
        from .terminal import printable

        try:
            return super().parse_args(ctx, bool_words(self.get_params(ctx), list(args)))
        except click.UsageError as e:
            e.message = printable(e.message)
            raise


class GroupedCommand(Command):
    """--help lists options under their group's heading, groups in the order they first appear."""

    def format_options(self, ctx, formatter):
        groups: dict[str, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record:
                groups.setdefault(getattr(param, "group", None) or "Other", []).append(record)
        groups["Other"] = groups.pop("Other", [])  # --config, --debug, --help last
        for name, records in groups.items():
            with formatter.section(f"{name} options"):
                formatter.write_dl(records)


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


def option_specs(cls, *, group: str | None = None, skip=(), enforce_required=True, aliases=None,
                 locations=None, domains=None) -> list[OptionSpec]:
    """One OptionSpec per init field of dataclass `cls`, in field order, in both spellings (--learning-rate and
    --learning_rate), default None so that only given values are collected (the dataclass keeps its defaults).
    enforce_required=False: required fields are checked by the caller, e.g. after merging a config file.
    `aliases`: {other name: field name}, more names of a field's option (both spellings of each). `locations`:
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
                f = click.option(*spec.decls, spec.name, type=spec.kind, multiple=spec.multiple, **common)(f)
        return f

    return decorate


def dataclass_options(cls, *, group: str | None = None, skip=(), enforce_required=True, aliases=None, locations=None,
                      domains=None):
    """A decorator adding one click option per init field of dataclass `cls` (option_specs)."""
    return spec_options(option_specs(cls, group=group, skip=skip, enforce_required=enforce_required, aliases=aliases,
                                     locations=locations, domains=domains))


def command_text(prog: str, values: dict, leading: tuple = ()) -> str:
    """The command line that gives these option values (click's names; None: not given), as a shell would take it:
    a boolean as --x / --no-x, a repeated option once per value, a whole number given to a float option as 50."""
    import shlex

    words = [prog, *map(str, leading)]
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{flag[2:]}")
        else:
            words += [w for v in (value if isinstance(value, list) else [value]) for w in (flag, number_text(v))]
    return " ".join(shlex.quote(w) for w in words)


def number_text(value) -> str:
    """A value as the user would type it: a whole number given to a float option (TrainingArguments' save_steps,
    logging_steps, ...) as an integer, 50 and not 50.0."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


def given_values(values: dict) -> dict:
    """The options actually given (None and empty repeatable options are 'not given')."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if v is not None and v != ()}
