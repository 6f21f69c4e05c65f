"""A command's options from a YAML or JSON file (--config), as TRL's scripts take theirs: one reader of the file
for every command (train-dpo adds TRL's DPOConfig keys on top, dpo/cli.py). A config file holds plain data only: it is
read with a safe loader and every value goes through its option's own type, as on the command line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click


def yaml_12(text: str):
    """YAML read with the core schema of YAML 1.2 (what TRL's YAML configs are written for), not PyYAML's YAML 1.1:
    `kl_target: 1:2` stays the text "1:2" (1.1 reads it as 62, base 60), `on`/`yes`/`no` stay words, `010` is ten and
    `1e-6` a number; every value then goes through its option's own type as on the command line."""
    import yaml

    class Core12Loader(yaml.SafeLoader):
        pass

    Core12Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag.rsplit(":", 1)[-1] not in ("bool", "int", "float")]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    core = {"bool": (r"^(?:true|True|TRUE|false|False|FALSE)$", list("tTfF")),
            "int": (r"^[-+]?[0-9]+$", list("-+0123456789")),
            "float": (r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
                      r"|\.(?:nan|NaN|NAN))$", list("-+.0123456789"))}
    for kind, (pattern, first) in core.items():
        Core12Loader.add_implicit_resolver(f"tag:yaml.org,2002:{kind}", re.compile(pattern), first)
    Core12Loader.add_constructor("tag:yaml.org,2002:int", lambda loader, node: int(loader.construct_scalar(node)))
    return yaml.load(text, Loader=Core12Loader)  # a SafeLoader: plain data only, no object ever built


def read_mapping(path) -> dict:
    """The file's mapping of option names to values (keys with `-` read as `_`); a file that is not valid JSON (a
    .json name) or YAML, or holds no mapping, is a usage error naming it."""
    import yaml

    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = json.loads(text) if path.endswith(".json") else yaml_12(text)
    except (ValueError, yaml.YAMLError) as e:  # ValueError: JSON errors and UnicodeDecodeError
        detail = " ".join(str(e).split())
        raise click.UsageError(f"{path}: not valid {'JSON' if path.endswith('.json') else 'YAML'} ({detail})") from None
    if not isinstance(data, dict):
        raise click.UsageError(f"{path}: expected a mapping of option names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


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
    values, unknown = {}, []
    for key, value in read_mapping(path).items():
        option, on = spellings.get(aliases.get(key, key), (None, True))
        if option is None:
            unknown.append(key)
        elif value is not None:
            converted = _converted(path, key, option, value)
            values[option.name] = converted if on else not converted
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
    kind = click.types.convert_type(kind)
    try:
        if multiple:
            return [kind.convert(v, param, None) for v in (value if isinstance(value, list) else [value])]
        return kind.convert(value, param, None)
    except click.BadParameter as e:
        named = f"{given_as} (TRL's name of {key})" if given_as and given_as != key else key
        raise click.UsageError(f"{path}: {named}: {e.message}") from None
