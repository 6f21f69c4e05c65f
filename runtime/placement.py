"""Where a reference's layers go when it does not fit one device: accelerate's big-model dispatch as transformers'
`from_pretrained(device_map=..., max_memory=..., offload_folder=...)` runs it (visible accelerators, then CPU
memory, then disk), or transformers' own tensor parallelism under torchrun (`from_pretrained(distributed_config=
DistributedConfig(tp_size=N, ...))`: the architecture's tensor-parallel plan, each group of N ranks one copy of the
model); the options that ask for them, the device a dispatched model takes its inputs on, and the layout a job
records. Nothing here loads or computes on its own: the numbers stay the model's own forward."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .errors import JobError

if TYPE_CHECKING:  # torch only where a device is made: audit-ref's report describes a layout without it
    import torch

DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # the strategies from_pretrained takes by name


def _size(text: str) -> str:
    """A memory size as accelerate reads it ("20GiB", "500MB", or a number of bytes), in bytes."""
    from accelerate.utils import convert_file_size_to_int

    text = text.strip()
    try:
        size = int(text) if text.isdigit() else convert_file_size_to_int(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(f"{text!r} is not a memory size (e.g. 20GiB, 500MB or a number of bytes)")
    return str(size)


def parse_max_memory(text: str) -> str:
    """--max-memory: `DEVICE=SIZE,...` (DEVICE a GPU index, or cpu) or one SIZE (the CPU's budget), written back as
    `device=bytes,...` so the same budget reads the same whatever the unit. A ValueError names what is wrong."""
    budgets = {}
    for part in [p for p in text.split(",") if p.strip()] or [""]:
        device, _, size = part.rpartition("=")
        device = device.strip().lower() or "cpu"
        if not (device == "cpu" or device.isdigit()):
            raise ValueError(f"device {device!r}: use a GPU index (0, 1, ...) or cpu, as in 0=20GiB,cpu=60GiB")
        if device in budgets:
            raise ValueError(f"device {device} is given twice")
        budgets[device] = _size(size)
    return ",".join(f"{d}={s}" for d, s in budgets.items())


def max_memory_dict(parsed: str | None) -> dict | None:
    """parse_max_memory's text as from_pretrained's max_memory ({0: bytes, "cpu": bytes})."""
    if not parsed:
        return None
    pairs = (p.split("=") for p in parsed.split(","))
    return {int(d) if d.isdigit() else d: int(s) for d, s in pairs}


def check_placement(device_map: str | None, max_memory: str | None, offload_folder: str | None, device: str,
                    world: int, adapter: str | None, prefix: str = "") -> None:
    """Refuse options that cannot go together, before any work. `prefix`: how the job names these options
    (train-dpo's live reference: "ref-", as in --ref-device-map)."""
    flag = lambda name: f"--{prefix}{name}"
    if device_map is None:
        given = [flag(name) for name, v in (("max-memory", max_memory), ("offload-folder", offload_folder)) if v]
        if given:
            raise JobError(f"{' and '.join(given)} place a model split by {flag('device-map')}; add "
                           f"{flag('device-map')} auto (or leave {' and '.join(given)} out)")
        return
    if device != "auto":
        raise JobError(f"--device {device} and {flag('device-map')} {device_map} both say where the model goes; give "
                       f"one ({flag('max-memory')} cpu=SIZE keeps a device map on the CPU)")
    if world > 1:
        raise JobError(f"{flag('device-map')} {device_map} splits one model over this process's devices, and this job "
                       f"runs {world} processes (torchrun) that would each take all of them; run it as one process")
    if adapter is not None:
        raise JobError(f"--adapter with {flag('device-map')} {device_map}: the adapter is merged into weights that are "
                       "only loaded as they run; merge it first (peft merge_and_unload, save_pretrained) and pass "
                       "the merged folder as --model")
    check_devices(max_memory, flag("max-memory"))


def check_devices(max_memory: str | None, flag: str = "--max-memory") -> None:
    """A budget (parse_max_memory's text) naming a GPU this machine does not have is refused before any weight is
    read, naming the GPUs there are (accelerate would otherwise fail deep in the load)."""
    gpus = sorted(int(d) for d in (max_memory or "").replace("=", ",").split(",")[::2] if d.isdigit())
    if not gpus:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [g for g in gpus if g >= count]
    if missing:
        have = f"has {count} ({', '.join(map(str, range(count)))})" if count else "has none (no CUDA device is visible)"
        raise JobError(f"{flag} {max_memory} names GPU {', '.join(map(str, missing))}, and this machine {have}: give "
                       f"only the GPUs there are, or cpu=SIZE alone to keep the model in CPU memory (and on disk), "
                       "e.g. " + flag + " cpu=8GiB; check CUDA_VISIBLE_DEVICES")


def check_tensor_parallel(tp_size: int, world: int, device: str, device_map: str | None, adapter: str | None,
                          torch_compile: bool) -> None:
    """Refuse a --tp-size that cannot run, before any work: groups of tp_size ranks need torchrun and a world that
    they divide; the split is transformers' own placement (one accelerator per rank, or the CPU)."""
    if tp_size == 1:
        return
    if world == 1:
        raise JobError(f"--tp-size {tp_size} splits the model across {tp_size} processes, and this job runs one; "
                       f"launch it with torchrun (torchrun --nproc-per-node {tp_size} -m precompute.cli ...), or "
                       "leave --tp-size out (--device-map auto splits a model within one process)")
    if world % tp_size:
        raise JobError(f"--tp-size {tp_size} makes groups of {tp_size} consecutive ranks, and this job runs {world} "
                       f"(torchrun's WORLD_SIZE), not a multiple of {tp_size}; launch a multiple of {tp_size} "
                       "processes in all or pick a --tp-size that divides it")
    clash = {"--device-map": (device_map, "another way to split the model; give one of the two"),
             "--device": (device != "auto", "each rank's part of the model goes where transformers puts it (the "
                          "accelerator LOCAL_RANK, else the CPU); leave --device at auto"),
             "--adapter": (adapter, "the weights are loaded split as they are; merge the adapter first (peft "
                           "merge_and_unload, save_pretrained) and pass the merged folder as --model"),
             "--torch-compile": (torch_compile, "the split model scores uncompiled; leave --torch-compile out")}
    for option, (given, why) in clash.items():
        if given:
            raise JobError(f"--tp-size {tp_size} with {option}{' ' + device if option == '--device' else ''}: {why}")


def tensor_parallel_refusal(config, tp_size: int) -> str | None:
    """Why transformers cannot split a model of `config` (a transformers PretrainedConfig) into tp_size parts, or
    None: the plan comes from the config class's base_model_tp_plan (of its text model in a composite one), and the
    plan cuts attention by heads, so tp_size must divide the query and the key/value heads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    if not (getattr(config, "base_model_tp_plan", None) or getattr(text, "base_model_tp_plan", None)):
        return (f"transformers has no tensor-parallel plan for {name} (model type {config.model_type}: its "
                f"{type(config).__name__} declares no base_model_tp_plan)")
    heads = {what: getattr(text, key, None) for what, key in (("attention heads", "num_attention_heads"),
                                                             ("key/value heads", "num_key_value_heads"))}
    for what, n in heads.items():
        if isinstance(n, int) and n % tp_size:
            return f"{name} has {n} {what}, which {tp_size} ranks cannot share evenly"
    return None


def distributed_config(tp_size: int, world: int):
    """transformers' DistributedConfig for groups of tp_size ranks over a world of `world`: the architecture's own
    tensor-parallel plan in each group and, with several groups, one whole copy per group (dp_replicate: transformers
    then also wraps each copy in FSDP2 with nothing to shard, so the groups never wait on each other in a forward)."""
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_size=tp_size, dp_replicate_size=world // tp_size)


def tensor_parallel_layout(tp_size: int, world: int) -> dict:
    """What a job records of a model split by --tp-size."""
    return {"kind": "tensor_parallel", "tp_size": tp_size, "groups": world // tp_size}


def cannot_split(what: str, device_map: str, max_memory: str | None, error: Exception, prefix: str = "") -> JobError:
    """The refusal of a model from_pretrained could not place with these options (`what` names the model, e.g.
    "--model DIR"; `prefix` as in check_placement)."""
    detail = " ".join(str(error).split())[:300]
    return JobError(f"{what}: the model cannot be split with --{prefix}device-map {device_map} --{prefix}max-memory "
                    f"{max_memory} ({detail}); give the devices more memory, or an --{prefix}offload-folder on a disk "
                    "with room")


def offload_dir(parent: str | None, flag: str, stack) -> Path:
    """A fresh folder of this job's own for the weights a device map puts on disk, inside `parent` (the job's
    --offload-folder, `flag`; None: the system's temporary folder), removed when `stack` (an ExitStack held for as
    long as the model runs) closes: a folder already in use keeps everything else in it."""
    import tempfile

    if parent is not None:
        try:
            Path(parent).resolve().mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JobError(f"{flag} {parent}: cannot make it ({e.strerror or e})") from None
    try:
        return Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="refcache-offload-", dir=None if parent is None else Path(parent).resolve())))
    except OSError as e:
        raise JobError(f"{flag} {parent}: cannot write there ({e.strerror or e})") from None


def main_device(max_memory: dict | None, fallback: torch.device) -> torch.device:
    """The device a dispatched model computes on first (accelerate's main device): the CPU when the budget names
    no GPU, else what --device auto gives."""
    if max_memory is not None and all(not isinstance(d, int) for d in max_memory):
        import torch

        return torch.device("cpu")
    return fallback


def input_device(model) -> torch.device:
    """Where a model's input ids go: for a model dispatched by a device map the first accelerator it uses, else
    the CPU (accelerate's hooks move each layer's inputs and weights from there); for any other model, its
    parameters' device."""
    import torch

    placed = getattr(model, "hf_device_map", None)
    if placed:
        on = [d for d in placed.values() if d not in ("cpu", "disk")]
        return torch.device(on[0]) if on else torch.device("cpu")
    return next(model.parameters()).device


def layout(model, device_map: str, max_memory: str | None, offload_used: bool) -> dict:
    """What a job records of a split: the device map asked for, the budget, whether the offload folder was written
    to, and which modules each device (or disk) holds ({"": device} is the whole model on one)."""
    placed = getattr(model, "hf_device_map", None) or {"": str(input_device(model))}
    modules: dict[str, list[str]] = {}
    for name, device in placed.items():
        modules.setdefault(str(device), []).append(name)
    return {"device_map": device_map, "max_memory": max_memory, "offload_folder_used": offload_used,
            "modules": {d: sorted(names) for d, names in sorted(modules.items())}}


def describe(layout_record: dict) -> str:
    """One line for audit-ref: the device map, budget, and module counts per place; or the tensor-parallel groups."""
    if layout_record.get("kind") == "tensor_parallel":
        groups = layout_record.get("groups")
        return (f"tensor parallelism over {layout_record.get('tp_size')} ranks per copy of the model, {groups} "
                f"group{'s' if groups != 1 else ''} (transformers' tensor-parallel plan)")
    modules = layout_record.get("modules") or {}
    where = ", ".join(f"{d}: {len(m)} module{'s' if len(m) != 1 else ''}" for d, m in modules.items())
    used = "written to" if layout_record.get("offload_folder_used") else "not written to"
    return (f"device map {layout_record.get('device_map')} (max memory {layout_record.get('max_memory') or 'all'}; "
            f"{where}; offload folder {used})")
