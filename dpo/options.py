"""train-dpo's options by field name: ours (TrainConfig), LoRA's (LoraOptions) and every other
transformers.TrainingArguments field (dpo/trainer_options.py), with each option's spec, the one source of its type
for the command line (dpo/cli.py) and --config (dpo/config_file.py) alike."""

from __future__ import annotations

import dataclasses

from runtime.options import option_specs

from .config import TrainConfig
from .lora import LoraOptions
from .trainer_options import trainer_specs

LORA = {f.name: f for f in dataclasses.fields(LoraOptions)}
OURS = {f.name: f for f in dataclasses.fields(TrainConfig) if f.metadata.get("cli") is not False} | LORA
# TrainingArguments fields that are not options: ours under the same name, the ones the recipe must set itself,
# and `debug` (our --debug shows tracebacks).
NOT_TRAINER_OPTIONS = set(OURS) | {"remove_unused_columns", "debug"}
# the TrainingArguments options, stored per installation (dpo/trainer_options.py): --help and a refusal of the
# command line do not import transformers and torch
TRAINER_SPECS = trainer_specs(NOT_TRAINER_OPTIONS)
TRAINER = {s.name for s in TRAINER_SPECS if not s.name.startswith("_")}
# every option's spec by field name, the one source of its type for the command line and --config alike
SPECS = {s.name: s for s in [*TRAINER_SPECS, *option_specs(LoraOptions),
                             *option_specs(TrainConfig, enforce_required=False, aliases=None)]}
REQUIRED = tuple(name for name, f in OURS.items() if f.metadata.get("required"))
