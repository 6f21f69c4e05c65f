"""One loader of a checkpoint split across devices by a device map (precompute-ref --device-map, train-dpo's live
reference with --ref-device-map, audit-ref's replay of a split cache): a fresh offload folder of the job's own,
from_pretrained with the budget, a placement it refuses named with what to change, and the layout the job records."""

from __future__ import annotations

import contextlib
from typing import Callable

from . import placement


def load_placed(load: Callable, what: str, device_map: str, max_memory: str | None, offload_folder: str | None,
                held: contextlib.ExitStack, prefix: str = ""):
    """(model, layout): `load(**placed)` called with from_pretrained's device_map, max_memory and offload_folder
    (a fresh folder inside `offload_folder`, removed when `held` closes); a ValueError from it (the model does not
    fit the budget) refused by placement.cannot_split naming `what`. `prefix` spells the options (train-dpo's
    "ref-")."""
    folder = placement.offload_dir(offload_folder, f"--{prefix}offload-folder", held)
    try:
        model = load(device_map=device_map, max_memory=placement.max_memory_dict(max_memory),
                     offload_folder=str(folder))
    except ValueError as e:
        raise placement.cannot_split(what, device_map, max_memory, e, prefix=prefix) from None
    return model, placement.layout(model, device_map, max_memory, any(folder.iterdir()))
