"""train-dpo's options generated from `transformers.TrainingArguments`, without importing transformers each time.

Importing TrainingArguments imports torch, transformers and (where installed) peft: about 2.5 s of CPU before
`train-dpo --help` or a mistyped option could answer. The options (runtime.options.OptionSpec) are therefore kept as
JSON in the user's cache folder, under a key of everything they are computed from: the installed versions of
transformers, torch and accelerate (TrainingArguments' defaults and types depend on them), the bytes of the
transformers modules that define the class and its enums, the bytes of the code here that turns fields into
options, and the fields train-dpo defines itself. Any change gives another key, so a stored table is never used for
another installation; a missing or unreadable one is computed again (and stored when the folder is writable).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from runtime import locations, options
from runtime.options import OptionSpec, option_specs
from runtime.paths import refcache_home

GROUP = "Training (every other transformers.TrainingArguments)"
FORMAT = 2  # 2: numeric kinds carry their domain
# the transformers modules TrainingArguments' fields, types and defaults are written in
SOURCES = ("training_args.py", "trainer_utils.py", "debug_utils.py")
VERSIONS = ("transformers", "torch", "accelerate")
# the TrainingArguments fields that name a file or folder, read as paths (runtime.locations.Location); their own help
# says which (tests/runtime/test_locations.py finds any other field whose help names a path, and fails until it is here)
LOCATIONS = {"accelerator_config": {"location": "input", "json_text": True},
             "logging_dir": {"location": "output"}}
# The domains (runtime/domains.py) of TrainingArguments' numeric fields that train-dpo does not define itself (those
# declare theirs in dpo/config.py), across the transformers versions that have them. A numeric field missing here
# (one a newer transformers adds) is taken as any finite number; tests/dpo/test_numeric_domains.py asks for it here.
TRAINER_DOMAINS = {
    "adam_beta1": "probability", "adam_beta2": "probability", "adam_epsilon": "nonnegative",
    "label_smoothing_factor": "probability", "neftune_noise_alpha": "nonnegative", "warmup_ratio": "probability",
    "eval_delay": "nonnegative", "eval_accumulation_steps": "count", "torch_empty_cache_steps": "count",
    "data_seed": "natural", "dataloader_prefetch_factor": "count", "ddp_bucket_cap_mb": "count",
    "ddp_timeout": "count", "tp_size": "count", "tpu_num_cores": "count", "logging_steps": "positive",
    "eval_steps": "positive", "save_steps": "positive", "save_total_limit": "natural",
    "local_rank": "integer", "past_index": "integer",
}


def cache_folder() -> Path:
    """refcache's own folder of caches (runtime.paths.refcache_home)."""
    return refcache_home()


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def table_key(skip) -> str | None:
    """The key of the option table for this installation and these train-dpo fields (`skip`), or None when
    transformers' source cannot be found (then the table is always computed)."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    digest = hashlib.sha256()
    parts = {"format": FORMAT, "python": list(sys.version_info[:2]), "skip": sorted(skip),
             "versions": {name: _version(name) for name in VERSIONS}}
    digest.update(json.dumps(parts, sort_keys=True).encode())
    ours = [Path(options.__file__), Path(locations.__file__), Path(__file__)]  # the code that turns fields into options
    for path in [folder / name for name in SOURCES] + ours:
        try:
            digest.update(path.read_bytes())
        except OSError:
            return None
    return digest.hexdigest()[:32]


def computed_specs(skip) -> list[OptionSpec]:
    """The option table from TrainingArguments itself (imports transformers, and with it torch)."""
    import transformers

    return option_specs(transformers.TrainingArguments, group=GROUP, skip=skip, locations=LOCATIONS,
                        domains=TRAINER_DOMAINS)


def _read(path: Path) -> list[OptionSpec] | None:
    from storage.files import UnsafeDestination, open_nofollow

    try:
        with os.fdopen(open_nofollow(path, os.O_RDONLY), "rb") as f:  # the table itself, never through a link
            stored = json.loads(f.read().decode("utf-8"))
        return [OptionSpec.from_json(s) for s in stored["options"]]
    except (OSError, ValueError, KeyError, TypeError, UnsafeDestination):  # missing, damaged, a link: computed again
        return None


def _store(path: Path, specs: list[OptionSpec]) -> None:
    from storage.files import UnsafeDestination, atomic_write

    text = json.dumps({"format": FORMAT, "options": [s.to_json() for s in specs]}, indent=1) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(text.encode("utf-8")))
    except (OSError, UnsafeDestination):  # a read-only home, a link planted there: computed again next time
        pass


def trainer_specs(skip) -> list[OptionSpec]:
    """TrainingArguments' init fields as options (not those in `skip`), from the stored table when there is one for
    this installation, else computed and stored."""
    key = table_key(skip)
    path = cache_folder() / f"train-dpo-options-{key}.json" if key else None
    specs = _read(path) if path else None
    if specs is None:
        specs = computed_specs(skip)
        if path:
            _store(path, specs)
    return specs
