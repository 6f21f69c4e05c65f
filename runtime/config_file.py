"""A command's options from a YAML or JSON file (--config), as TRL's scripts take theirs: one reader of the file
for every command (train-dpo adds TRL's DPOConfig keys on top, dpo/cli.py). A config file holds plain data only: it is
read with a safe loader and every value goes through its option's own type, as on the command line."""

from __future__ import annotations

import json
import re

import click

from .terminal import escaped


# far beyond any real config (TRL's recipes are a few KiB): a larger file, or a device, is refused before it is read
MAX_BYTES = 1 << 20


def _loader(path: str):
    """A PyYAML safe loader reading YAML 1.2's core schema (what TRL's YAML configs are written for), not YAML 1.1:
    `kl_target: 1:2` stays the text "1:2" (1.1 reads it as 62, base 60), `on`/`yes`/`no` stay words, `010` is ten,
    `1e-6` a number, `<<` a plain key (no merge) and a date text. Anchors and aliases are refused where they occur
    (an alias repeats a subtree without writing it, so a few hundred bytes expand to gigabytes), and a key given
    twice in one mapping unless both give the same value."""
    import yaml

    class Core12Loader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                raise click.UsageError(f"{path}: line {event.start_mark.line + 1}: YAML anchors and aliases are not "
                                       "taken in a config file; write the value out")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            pairs = [(self.construct_object(k, deep=True), self.construct_object(v, deep=True), k.start_mark.line + 1)
                     for k, v in node.value]
            return one_each(path, pairs)

    # of SafeLoader's implicit types only null is YAML 1.2 core's as it is (no merge, timestamp or value)
    Core12Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag == "tag:yaml.org,2002:null"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    core = {"bool": (r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
            "int": (r"^[-+]?[0-9]+$", list("-+0123456789")),
            "float": (r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
                      r"|\.(?:nan|NaN|NAN))$", list("-+.0123456789"))}
    for kind, (pattern, first) in core.items():
        Core12Loader.add_implicit_resolver(f"tag:yaml.org,2002:{kind}", re.compile(pattern), first)
    Core12Loader.add_constructor("tag:yaml.org,2002:int", lambda loader, node: int(loader.construct_scalar(node)))
    return Core12Loader


def yaml_12(text: str, path: str = "<text>"):
    """YAML read with the core schema of YAML 1.2 (_loader): plain data only, no object ever built, no alias."""
    return _yaml_with_lines(text, path)[0]


def _yaml_with_lines(text: str, path: str) -> tuple:
    """The file's data, and {top-level key: its line}."""
    import yaml

    loader = _loader(path)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        data = loader.construct_document(node)
        lines = {}
        if isinstance(node, yaml.MappingNode):
            lines = {loader.construct_object(k): k.start_mark.line + 1 for k, _ in node.value}
        return data, lines
    finally:
        loader.dispose()


def _same(a, b) -> bool:
    """Whether two values of a file are the same value: of one type (1, 1.0 and true differ) and equal (NaN never)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


def one_each(path: str, pairs, name_of=None) -> dict:
    """A mapping from (key, value, line or None) pairs, where an option is given once: two keys naming one option
    (the same key; with `name_of`, its name for a key: `rows-per-shard` and `rows_per_shard`, or TRL's name and
    ours) are refused naming the file and both keys, unless both give the same value."""
    out, first = {}, {}  # first: the option's name -> (the key, its value, its line) as first given
    for key, value, line in pairs:
        name = name_of(key) if name_of else key
        try:
            hash(name)
        except TypeError:
            raise click.UsageError(f"{path}: {_at(line)}a key that is a list or a mapping; a key is an option's "
                                   "name") from None
        if name in first:
            key0, value0, line0 = first[name]
            if not _same(value0, value):
                k0, k1 = escaped(key0), escaped(key)
                both = f"{k0} is given twice" if key0 == key else f"{k0} and {k1} both give {escaped(name)}"
                raise click.UsageError(
                    f"{path}: {_at(line)}{both} ({_at(line0)}{_short(value0)}; {_at(line)}"
                    f"{_short(value)}): an option is given once in a config file; keep one")
            continue
        first[name] = (key, value, line)
        out[key] = value
    return out


def _at(line, then=": ") -> str:
    return f"line {line}{then}" if line is not None else ""


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def read_text(path) -> str:
    """The text of a config file: a regular file (a symlink to one is fine) of at most MAX_BYTES, read with a bounded
    read from the file opened (a device, a FIFO or a folder is refused without reading it or waiting on it:
    storage.reads.record_bytes)."""
    from storage.reads import NotARecord, record_bytes

    path = str(path)
    try:
        data = record_bytes(path, MAX_BYTES)
    except NotARecord as e:
        if e.kind:
            raise click.UsageError(f"{path}: not a regular file (a config file is a YAML or JSON file)") from None
        if e.size is not None:
            raise click.UsageError(f"{path}: {e.size} bytes; a config file is at most {MAX_BYTES} bytes (1 MiB): is "
                                   "this the file meant?") from None
        raise click.UsageError(f"{path}: over {MAX_BYTES} bytes; a config file is at most {MAX_BYTES} bytes "
                               "(1 MiB)") from None
    except OSError as e:
        raise click.UsageError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise click.UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None


class FileValues(dict):
    """A config file's values by option, and `written`: {option: the key as the file wrote it} (dataset_name,
    ref-cache), so that a refusal names the key the user wrote."""

    def __init__(self, values=(), written=None):
        super().__init__(values)
        self.written = dict(written or {})


def read_mapping(path, name_of=None) -> dict:
    """The file's mapping of option names to values (keys with `-` read as `_`), each option given once (one_each;
    `name_of`: the option a key names, as the command reads it). A file that is not valid JSON (a .json name) or
    YAML, holds no mapping, or gives an option twice, is a usage error naming it."""
    import yaml

    path = str(path)
    text = read_text(path)
    json_file = path.endswith(".json")
    try:
        if json_file:
            data = json.loads(text, object_pairs_hook=lambda pairs: one_each(path, [(k, v, None) for k, v in pairs]))
            lines = {}
        else:
            data, lines = _yaml_with_lines(text, path)
    except (ValueError, RecursionError, yaml.YAMLError) as e:  # ValueError: JSON errors
        detail = _short(" ".join(str(e).split()), 300)
        raise click.UsageError(f"{path}: not valid {'JSON' if json_file else 'YAML'} ({detail})") from None
    if not isinstance(data, dict):
        raise click.UsageError(f"{path}: expected a mapping of option names to values")

    def option(key):
        key = str(key).replace("-", "_")
        return name_of(key) if name_of else key

    given = one_each(path, [(k, v, lines.get(k)) for k, v in data.items()], option)
    return FileValues({str(k).replace("-", "_"): v for k, v in given.items()},
                      {str(k).replace("-", "_"): str(k) for k in given})


def options_from_file(path, command: click.Command, prog: str, aliases: dict, *, skip=("config_file", "debug")) -> dict:
    """A command's option values from --config `path`, by the command's own options (any name the command line takes
    for them, TRL's spellings included, or `aliases`): each value converted by its option's type, exactly as the
    command line converts it; a key that names a flag's off switch (`disable_tqdm: true` for --no-progress) reads
    as that switch does. An unknown key, or a value its option refuses, is a usage error naming the file, the key
    and the reason."""
    spellings = {}  # key -> (option, whether the key turns a flag on)
    for p in command.params:
        if isinstance(p, click.Option) and p.name not in skip:
            for names, on in ((p.secondary_opts, False), (p.opts, True), ([p.name], True)):
                spellings.update({n.lstrip("-").replace("-", "_"): (p, on) for n in names})
    # the command's own option of a name wins over the alias table (precompute-ref's --dtype is not --model-dtype)
    aliases = {k: v for k, v in aliases.items() if k not in spellings}

    def option_of(key: str):
        return spellings.get(aliases.get(key, key), (None, True))

    def name_of(key: str) -> str:
        option = option_of(key)[0]
        return option.name if option is not None else key

    values, unknown = FileValues(), []
    mapping = read_mapping(path, name_of)
    for key, value in mapping.items():
        option, on = option_of(key)
        if option is None:
            unknown.append(key)
        elif value is not None:
            converted = _converted(path, key, option, value)
            values[option.name] = converted if on else not converted
            values.written[option.name] = mapping.written.get(key, key)
    if unknown:
        raise click.UsageError(f"{path}: unknown option(s) {', '.join(sorted(unknown))} (see `{prog} "
                               "--help`: a key is an option's name, with _ or -)")
    return values


def _converted(path, key: str, option: click.Option, value):
    if option.is_flag and option.is_bool_flag:
        if isinstance(value, bool):
            return value
        value = str(value).lower()
        from .cli import FALSE_WORDS, TRUE_WORDS

        if value in TRUE_WORDS | FALSE_WORDS:
            return value in TRUE_WORDS
        raise click.UsageError(f"{path}: {key}: {value!r} is not true or false")
    return converted(path, key, option.type, value, multiple=option.multiple, param=option)


def converted(path, key: str, kind, value, *, multiple: bool = False, param=None, given_as: str | None = None):
    """A config file's value through its option's own type (a click type, or one of bool, int, float, str), as the
    command line converts it, for every command's --config: a refusal (a bad choice, a number out of its domain, a
    path that is not there) is a usage error naming the file and the key (`given_as`: the key as the file spells it,
    TRL's name of ours), then the type's own reason."""
    from .options import TEXT

    kind = TEXT if kind is str else click.types.convert_type(kind)
    try:
        if multiple:
            return [kind.convert(v, param, None) for v in (value if isinstance(value, list) else [value])]
        return kind.convert(value, param, None)
    except click.BadParameter as e:
        named = f"{given_as} (TRL's name of {key})" if given_as and given_as != key else key
        raise click.UsageError(f"{path}: {named}: {e.message}") from None
