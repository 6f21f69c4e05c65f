"""How a model is placed and loaded, declared once for every command that loads one: the option group `Placement`
(a checkpoint split across devices by a device map: precompute-ref --device-map, train-dpo's live reference with
--ref-device-map, audit-ref's replay) and `Attention` (the attention kernel: precompute-ref, train-dpo), each
included in a command's config as flat fields by `included` (train-dpo's placement with the ref_ prefix); the checks
of a placement, and the one loader of a split checkpoint (`load_placed`): a fresh offload folder of the job's own,
from_pretrained with the budget, a placement it refuses named with what to change, and the layout the job records.

Nothing here imports a model library: the commands build their options and --help from these declarations."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Callable

import click

from . import placement
from .options import field_help
from .errors import JobError
from .paths import check_apart


@dataclass(frozen=True)
class Placement:
    """A model split by accelerate's big-model dispatch (transformers' from_pretrained(device_map=..., max_memory=...,
    offload_folder=...)). Every field but `prefix` is an option of each command that includes the group, named
    `prefix` + field name; a field's help names the group's options as --device-map, ..., spelt with the prefix
    where the group is included. `Placement.of(config)` reads the group whole from a config (whose `included`
    fields are read as the command line reads them: the budget in `parse_max_memory`'s one form)."""

    device_map: str | None = field(default=None, metadata=field_help(
        "The model is split across the visible GPUs, then CPU memory, then disk (accelerate's big-model dispatch "
        "through transformers' from_pretrained(device_map=...)), in one process.", choices=placement.DEVICE_MAPS))
    max_memory: str | None = field(default=None, metadata=field_help(
        "With --device-map: the memory each device may hold, DEVICE=SIZE,... (e.g. 0=20GiB,1=20GiB,cpu=60GiB), or "
        "one SIZE for the CPU; what does not fit goes to disk.", parse=placement.parse_max_memory,
        metavar="DEVICE=SIZE,...", show_default="what accelerate finds free"))
    offload_folder: str | None = field(default=None, metadata=field_help(
        "With --device-map: folder for weights offloaded to disk (a fresh folder is made inside it and removed at the "
        "end); apart from every input and output of the command.", click_type=click.Path(file_okay=False),
        location="output", show_default="a temporary folder"))
    prefix: str = field(default="", metadata={"cli": False})  # the options' names: "ref_" for --ref-device-map

    @classmethod
    def of(cls, config) -> Placement:
        """The group as `config` (a dataclass that `included` it) holds it."""
        prefix = prefix_of(type(config), cls)
        return cls(**{name: getattr(config, prefix + name) for name in group_options(cls)}, prefix=prefix)

    def flag(self, name: str) -> str:
        """The option of field `name` as the command spells it (--ref-max-memory)."""
        return "--" + (self.prefix + name).replace("_", "-")

    @property
    def split(self) -> bool:
        return self.device_map is not None

    def given(self) -> list[str]:
        """The options of the group given, as the command spells them."""
        return [self.flag(name) for name in group_options(type(self)) if getattr(self, name) is not None]

    def check(self, device: str = "auto", world: int = 1, adapter: str | None = None) -> None:
        """Refuse options that cannot go together (runtime/placement.py check_placement), before any work."""
        placement.check_placement(self.device_map, self.max_memory, self.offload_folder, device, world, adapter,
                                  prefix=self.prefix.replace("_", "-"))

    def check_apart(self, others: dict | Callable[[], dict]) -> None:
        """The offload folder is an output: apart from every place in `others` ({option: location}, or a function
        returning it, called only where there is an offload folder)."""
        if self.offload_folder is not None:
            check_apart(self.offload_folder, self.flag("offload_folder"), others() if callable(others) else others)

    def main_device(self, fallback):
        """The device the model computes on first: the CPU when a split's budget names no GPU, else `fallback`."""
        return placement.main_device(placement.max_memory_dict(self.max_memory), fallback) if self.split else fallback

    def cannot_split(self, what: str, error: Exception) -> JobError:
        """The refusal of a split from_pretrained could not place (`what` names the model)."""
        return placement.cannot_split(what, self.device_map, self.max_memory, error,
                                      prefix=self.prefix.replace("_", "-"))


# transformers' attention implementations (from_pretrained's attn_implementation) that need a package beyond torch:
# (the module transformers imports, its pip name); transformers also runs them from the `kernels` package's builds
FLASH_PACKAGES = {"flash_attention_2": ("flash_attn", "flash-attn"),
                  "flash_attention_3": ("flash_attn_interface", "flash-attn-3"),
                  "flash_attention_4": ("flash_attn", "flash-attn-4")}
ATTENTION = ("auto", "eager", "sdpa", *FLASH_PACKAGES, "flex_attention")


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def attention_here() -> list[str]:
    """The attention implementations this installation can load (a flash one only where its package, or transformers'
    `kernels` fall-back, is installed); flex_attention needs a CUDA device besides (flex_on_cpu)."""
    kernels = _installed("kernels")
    return [a for a in ATTENTION if a not in FLASH_PACKAGES or kernels or _installed(FLASH_PACKAGES[a][0])]


HUB_KERNEL = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w.-]+)?(:[\w.-]+)?")


def is_hub_kernel(value) -> bool:
    """An attention implementation that names a kernel on the hub (org/name): code transformers downloads and runs,
    only with --trust-remote-code (attention_of; a checkpoint's config.json naming one: runtime.checkpoint)."""
    return isinstance(value, str) and "/" in value


def parse_attention(text: str) -> str:
    """--attn-implementation, checked where the options are read (before any model or cache is): one of transformers'
    names that this installation can load, or a hub kernel (`org/name`, loaded by transformers' `kernels`). A
    ValueError says what is wrong and lists only the values that work here."""
    text = str(text).strip()
    if is_hub_kernel(text):  # a hub kernel's repo id (org/name, a revision after @, a kernel after :), nothing else
        if not HUB_KERNEL.fullmatch(text):
            raise ValueError(f"{text!r} is not a hub kernel's id (org/name, e.g. kernels-community/flash-attn)")
        return text
    here = attention_here()
    listed = ", ".join(a + (" (on CUDA)" if a == "flex_attention" else "") for a in here)  # flex_on_cpu: not on CPU
    if text in FLASH_PACKAGES and text not in here:
        module, pip = FLASH_PACKAGES[text]
        raise ValueError(f"{text} is supported, but its package is not installed here ({module}: pip install {pip}, "
                         f"on a CUDA machine); use one of {listed} (auto: what transformers picks for the model)")
    if text not in here:
        raise ValueError(f"{text!r} is not an attention implementation; use one of {listed} (auto: what "
                         "transformers picks for the model)")
    return text


@dataclass(frozen=True)
class Attention:
    """The attention kernel a command loads its model(s) with (TRL's ModelConfig.attn_implementation)."""

    attn_implementation: str = field(default="auto", metadata=field_help(
        "Attention kernel: auto (what transformers picks for the model), sdpa, eager, flash_attention_2 (with the "
        "flash-attn package), flex_attention (CUDA), or a hub kernel (org/name).", parse=parse_attention,
        metavar="NAME"))


def group_options(group) -> list[str]:
    """The fields of an option group that are options."""
    return [f.name for f in dataclasses.fields(group) if f.metadata.get("cli") is not False]


def prefix_of(config_cls, group) -> str:
    """The prefix of `group`'s options in a config class that `included` it (a KeyError where it did not)."""
    return config_cls._included_groups[group]


def included(group, *, after: str, prefix: str = "", section: str | None = None, notes: dict | None = None):
    """Class decorator, under @dataclass: the options of `group` (a dataclass of option fields) as flat fields of a
    command's config, named `prefix` + field name, placed after its field `after` (their place in --help and in a
    config's fields), under the --help section `section`; `notes`: {field name: text} added to that option's help
    (what it does in this command, as written). Names, types, defaults and metadata (choices, parse, domain,
    location) are the group's, so a field added to the group is an option of every command that includes it, on the
    command line and in a --config alike."""

    def help_of(f: dataclasses.Field) -> str:
        text = f.metadata["help"]
        for name in group_options(group):  # the group's own options, as this command spells them
            text = text.replace(f"--{name.replace('_', '-')}", f"--{(prefix + name).replace('_', '-')}")
        return " ".join(x for x in (text, (notes or {}).get(f.name)) if x)

    def include(cls):
        own = dict(cls.__dict__.get("__annotations__", {}))
        names = list(own)
        at = names.index(after) + 1
        added = {}
        for f in dataclasses.fields(group):
            if f.metadata.get("cli") is False:
                continue
            added[prefix + f.name] = f.type
            metadata = {**f.metadata, "help": help_of(f), "group": section}
            setattr(cls, prefix + f.name, field(default=f.default, metadata=metadata))
        clash = set(added) & set(own)
        if clash:
            raise TypeError(f"{cls.__name__}: {', '.join(sorted(clash))} declared by the class and by {group.__name__}")
        cls.__annotations__ = {**{n: own[n] for n in names[:at]}, **added, **{n: own[n] for n in names[at:]}}
        cls._included_groups = {**getattr(cls, "_included_groups", {}), group: prefix}
        before = cls.__dict__.get("__post_init__")

        def __post_init__(self):
            if before is not None:
                before(self)
            _read_parsed(self, [prefix + name for name in group_options(group)])

        cls.__post_init__ = __post_init__
        return cls

    return include


def _read_parsed(config, names: list[str]) -> None:
    """The fields `names` of `config` with `parse` metadata written in their one form, as the command line's
    ParsedText reads them (a config made in code reads the same as one from the command line); a bad value is a
    usage error naming the option."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name not in names or "parse" not in f.metadata or value is None:
            continue
        try:
            setattr(config, f.name, f.metadata["parse"](value))
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint=f"'--{f.name.replace('_', '-')}'") from None


def load_placed(load: Callable, what: str, placed: Placement, held: contextlib.ExitStack):
    """(model, layout): `load(**kwargs)` called with from_pretrained's device_map, max_memory and offload_folder of
    the placement (the offload folder a fresh one inside its --offload-folder, removed when `held` closes); a
    ValueError from it (the model does not fit the budget) refused naming `what` and the options to change."""
    folder = placement.offload_dir(placed.offload_folder, placed.flag("offload_folder"), held)
    try:
        model = load(device_map=placed.device_map, max_memory=placement.max_memory_dict(placed.max_memory),
                     offload_folder=str(folder))
    except ValueError as e:
        raise placed.cannot_split(what, e) from None
    return model, placement.layout(model, placed.device_map, placed.max_memory, any(folder.iterdir()))


def attention_refused(what: str, attention: str, checkpoint, error: Exception) -> JobError:
    """The refusal of an attention implementation the model or this installation cannot use, naming those the
    model's class declares (`checkpoint`: a runtime.checkpoint.Checkpoint)."""
    import torch

    detail = " ".join(str(error).split())[:300]
    usable = set(attention_here()) - (set() if torch.cuda.is_available() else {"flex_attention"})
    choices = [a for a in checkpoint.attention_choices() if a in usable]  # what the model declares and works here
    return JobError(f"{what}: the model cannot be loaded with --attn-implementation {attention} ({detail}); it "
                    f"supports: {', '.join(choices)}, or leave --attn-implementation at auto")


def _flex_refusal(given: str, why: str) -> JobError:
    usable = ", ".join(a for a in attention_here() if a != "flex_attention")
    return JobError(f"{given}flex_attention needs a CUDA device, and {why} (on CPU torch's FlexAttention has no "
                    f"backward and its compiled kernels may not build); use one of {usable} here (auto: what "
                    "transformers picks for the model)")


def check_flex_here(config, device: str | None = None, device_field: str = "device") -> None:
    """--attn-implementation flex_attention where the run would compute on the CPU, refused as the job starts (the
    first point that imports torch), before any data, tokenizer, model or cache work: named as given (the option as
    typed, or the config file's key: runtime.locations.named), with what works here. `device`: the device the
    options ask for (None or auto: the machine's), `device_field` the option that asked (device, use_cpu)."""
    if getattr(config, "attn_implementation", None) != "flex_attention":
        return
    import torch

    from .locations import named

    try:
        asked_cpu = device not in (None, "auto") and torch.device(device).type == "cpu"
    except RuntimeError:  # a bad --device: its own check names it
        asked_cpu = False
    if asked_cpu:
        value, given = getattr(config, device_field), named(config, device_field)
        flag = value is True and given.startswith("--")  # --use-cpu (a file's `use_cpu: true` shows its value)
        asked = given.rstrip() if flag else given + ("true" if value is True else str(value))
        raise _flex_refusal(named(config, "attn_implementation"), f"{asked} runs it on the CPU")
    if not torch.cuda.is_available():
        raise _flex_refusal(named(config, "attn_implementation"), "this machine has none")


def flex_on_cpu(what: str, attention: str | None, device) -> None:
    """FlexAttention on a CPU is refused before the model loads: torch compiles it, and on CPU it has no backward
    (train-dpo stopped with NotImplementedError at its first step) and its kernels may not build (precompute-ref
    stopped in inductor's C++ compile after its probe). The commands refuse it earlier (check_flex_here); this is
    the check of every load."""
    import torch

    on_cpu = (torch.device(device).type == "cpu") if device is not None else not torch.cuda.is_available()
    if attention == "flex_attention" and on_cpu:
        raise _flex_refusal(f"{what}: --attn-implementation ", "the model would load on the CPU")


def attention_of(config) -> str | None:
    """The config's attention implementation as from_pretrained takes it (None: transformers' choice)."""
    value = getattr(config, "attn_implementation", None)
    if is_hub_kernel(value) and not getattr(config, "trust_remote_code", False):
        raise JobError(f"--attn-implementation {value}: a hub kernel is code downloaded from the hub and run (by "
                       "transformers' kernels package); pass --trust-remote-code to allow it, or use sdpa or eager")
    return None if value in (None, "auto") else value
