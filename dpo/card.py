"""The model card (README.md with Hugging Face model-card metadata) train-dpo writes into --output-dir and, with
--merge-adapter, into merged/: what was trained, from which base, on which data, against which reference (cache
identity and stamps, or a live model), with which options, and the final metrics. Built from the run manifest, so
it says nothing the manifest does not; rendered with huggingface_hub's ModelCard."""

from __future__ import annotations

import json
from pathlib import Path

from storage.files import atomic_write

CARD = "README.md"
TAG = "refcache"  # a card carrying this tag is one train-dpo wrote (dpo/resume.py: --overwrite-output-dir retires it)
METRIC_SKIP = ("step", "epoch", "learning_rate", "grad_norm")
OPTIONS = ("loss_type", "beta", "label_smoothing", "rpo_alpha", "ld_alpha", "tdpo_alpha", "kl_coef", "learning_rate",
           "lr_scheduler_type", "warmup_steps", "num_train_epochs", "max_steps", "per_device_train_batch_size",
           "gradient_accumulation_steps", "max_grad_norm", "weight_decay", "optim", "seed", "model_dtype", "bf16",
           "fp16", "gradient_checkpointing")
LORA_OPTIONS = ("lora_r", "lora_alpha", "lora_dropout")
OFF = {"label_smoothing": 0.0, "rpo_alpha": 0.0, "ld_alpha": 1.0, "kl_coef": 0.0}  # loss options at "not used"

TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

{{ summary }}

## Base model

{{ base }}

## Data

{{ data }}

## Reference

{{ reference }}

## Training options

{{ options }}

All options, the cache verification report and the software versions are in the run's `run-manifest.json`;
`audit-ref CACHE --run OUTPUT_DIR` checks the run against its cache.

## Results

{{ results }}
{% if plot %}
![training and evaluation metrics]({{ plot }})
{% endif %}
## Use

```python
{{ usage }}
```

Trained with refcache `train-dpo` ({{ software }}).
"""


RUN_KEY = "refcache_run"  # the card's metadata: the run id of the run that wrote it


def is_card(path: Path, run_id: str | None = None) -> bool:
    """A model card train-dpo wrote: its metadata (YAML, read safely) tags it `refcache` and names the run that
    wrote it (RUN_KEY); with `run_id`, that run. A tag alone proves nothing: a cache's dataset card (precompute-ref)
    carries it too, and anyone can write one."""
    from huggingface_hub import metadata_load

    try:
        meta = metadata_load(path)
    except Exception:  # not UTF-8, a YAML error: not a card of ours
        return False
    return (isinstance(meta, dict) and isinstance(meta.get("tags"), list) and TAG in meta["tags"]
            and isinstance(meta.get(RUN_KEY), str) and run_id in (None, meta[RUN_KEY]))


def write_cards(out: Path, manifest: dict) -> list[Path]:
    """README.md in the output dir (the adapter or the full model) and, where the LoRA adapter was merged, in
    merged/; each written atomically, never through a link. Returns the paths written."""
    out = Path(out)
    from .metrics import metrics_records

    records = metrics_records(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []
    plot = manifest.get("config", {}).get("plot") and (out / "metrics.png").is_file()
    peft = manifest.get("peft")
    folders = [(out, "adapter" if peft else "model", "metrics.png")]
    if peft and peft.get("merged_model_hash"):
        folders.append((out / "merged", "merged", "../metrics.png"))
    written = []
    for folder, kind, plot_path in folders:
        card = model_card(manifest, records, kind=kind, plot=plot_path if plot else None)
        data = (str(card).rstrip("\n") + "\n").encode("utf-8")
        atomic_write(folder / CARD, lambda f, data=data: f.write(data))
        written.append(folder / CARD)
    return written


def model_card(manifest: dict, records: list[dict], *, kind: str, plot: str | None = None):
    """The card of one folder of a run: `kind` adapter (the LoRA adapter), model (the full model) or merged (the base
    with the adapter merged in); `records`: metrics.jsonl; `plot`: the path of metrics.png from the folder."""
    from huggingface_hub import ModelCard, ModelCardData

    base, data, eval_data = manifest["initial_model"], manifest["data"], manifest.get("eval_data")
    config, peft = manifest.get("config") or {}, manifest.get("peft")
    datasets = list(dict.fromkeys(d["hub_id"] for d in (data, eval_data) if d and d.get("hub_id")))
    meta = ModelCardData(
        base_model=base.get("hub_id"), datasets=datasets or None, license=base_license(base["path"]),
        library_name="peft" if kind == "adapter" else "transformers", pipeline_tag="text-generation",
        tags=["dpo", TAG] + (["lora"] if peft else []), **{RUN_KEY: manifest.get("run_id")},
        refcache_reference=reference_metadata(manifest["reference"]))
    return ModelCard.from_template(
        meta, template_str=TEMPLATE, title=_title(manifest), summary=_summary(manifest, kind),
        base=_base(base, peft), data=_data(data, eval_data), reference=_reference(manifest["reference"], peft),
        options=_options(config, manifest.get("result") or {}, peft, manifest.get("kl_control")), results=_results(manifest, records),
        plot=plot, usage=_usage(kind, base, peft), software=_software(manifest.get("software") or {}))


def reference_metadata(reference: dict) -> dict:
    """The reference a run trained against, machine-readable in the card's YAML header (`refcache_reference`): the
    reference model (hub id, else absolute path) and its model hash, and per cache its cache_id, version and path."""
    caches = {role: reference.get(key) for role, key in (("train", "cache"), ("eval", "eval_cache"))
              if isinstance(reference.get(key), dict)}
    if not caches:
        live = reference.get("live_model") or {}
        return {"model": live.get("hub_id") or live.get("path"), "model_hash": live.get("model_hash"), "cache": None}
    train = next(iter(caches.values()))
    out = {"model": _cache_model(train), "model_hash": (train.get("stamps") or {}).get("model_hash")}
    for role, record in caches.items():
        out[f"{role}_cache"] = {"cache_id": record.get("cache_id"), "version": _cache_version(record),
                                "path": record.get("path")}
    return out


def _cache_version(record: dict) -> int | None:
    """The version of an updated cache a run used (precompute-ref --update): the record's, else that of the cache's
    manifest when it is still the one recorded (same cache_id); None when it cannot be told."""
    if record.get("version") is not None:
        return record["version"]
    try:
        from schemas.history import version_of
        from schemas.run_manifest import cache_id

        manifest = json.loads((Path(record["path"]) / "manifest.json").read_text(encoding="utf-8"))
        return version_of(manifest) if cache_id(manifest) == record.get("cache_id") else None
    except (OSError, ValueError, TypeError, KeyError):
        return None


def base_license(model_dir: str) -> str | None:
    """The license the base model declares: its model card's metadata, else its config.json."""
    from huggingface_hub import metadata_load

    folder = Path(model_dir)
    try:
        found = (metadata_load(folder / CARD) or {}).get("license") if (folder / CARD).is_file() else None
        if found is None:
            found = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("license")
    except Exception:  # an unreadable card or config says nothing about the license
        return None
    return found if isinstance(found, str) else None


# ---------------------------------------------------------------------------------------------------------------
# the sections, as markdown


def _table(header: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        return "" if v is None else str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, r)) + " |" for r in rows])


def _code(v) -> str | None:
    return None if v is None else f"`{v}`"


def _named(given: dict) -> str:
    """A model or data set as given: its hub id (at its revision), else its path."""
    if given.get("hub_id"):
        return f"`{given['hub_id']}`" + (f" (revision `{given['revision']}`)" if given.get("revision") else "")
    return f"`{Path(given['path']).resolve()}`"


def _title(manifest: dict) -> str:
    name = (manifest.get("config") or {}).get("training_args", {}).get("run_name")
    base = manifest["initial_model"]
    return f"{name or 'DPO'} of {base.get('hub_id') or Path(base['path']).resolve().name}"


def _summary(manifest: dict, kind: str) -> str:
    config, peft = manifest.get("config") or {}, manifest.get("peft")
    how = (f"DPO (loss `{config.get('loss_type')}`, beta {config.get('beta')}) with refcache `train-dpo`, against "
           + ("a reference cache (the reference log-probs were computed once by `precompute-ref` and verified "
              "before training)" if manifest["reference"].get("cache") else
              "a live reference model (no cache: the reference ran beside the policy during training)"))
    base = _named(manifest["initial_model"])
    if kind == "model":
        return f"This folder holds {base} fine-tuned with {how}."
    options = peft.get("options") or {}
    lora = f"r {options.get('lora_r')}, alpha {options.get('lora_alpha')}"
    if kind == "merged":
        text = (f"This folder holds {base} with the LoRA adapter ({lora}) of the run merged in: a plain transformers "
                f"model. The adapter, in the parent folder, was trained with {how}.")
    else:
        text = (f"This folder holds a LoRA adapter ({lora}) for {base}, trained with {how}. "
                "`adapter_config.json` names the base model (`base_model_name_or_path`).")
    if peft.get("init_adapter"):
        text += (f" Training started from the base with the adapter `{peft['init_adapter']['path']}` merged in, so "
                 "this adapter applies to that merge, not to the plain base.")
    return text


def _base(base: dict, peft: dict | None) -> str:
    rows = [["path", _code(Path(base["path"]).resolve())]]
    if base.get("hub_id"):
        rows += [["hub id", _code(base["hub_id"])], ["revision", _code(base.get("revision"))]]
    rows.append(["model hash", _code(base.get("model_hash"))])
    if peft and peft.get("init_adapter"):
        rows += [["initial adapter", _code(peft["init_adapter"].get("path"))],
                 ["initial adapter hash", _code(peft["init_adapter"].get("adapter_hash"))]]
    return _table(["", "base model"], rows) + ("\n\nModel hashes are refcache's (schemas/FORMAT.md: config and "
                                              "weights, independent of file layout).")


def _data(data: dict, eval_data: dict | None) -> str:
    sets = [("train", data)] + ([("eval", eval_data)] if eval_data else [])
    rows = [["path"] + [_code(d.get("path")) for _, d in sets],
            ["hub id"] + [_code(d.get("hub_id")) for _, d in sets],
            ["split"] + [_code(d.get("split")) for _, d in sets],
            ["rows"] + [d.get("rows") for _, d in sets],
            ["fingerprint"] + [_code(d.get("fingerprint")) for _, d in sets]]
    return _table([""] + [name for name, _ in sets], [r for r in rows if any(v is not None for v in r[1:])])


def _reference(reference: dict, peft: dict | None) -> str:
    caches = [(role, reference.get(key)) for role, key in (("train", "cache"), ("eval", "eval_cache"))
              if reference.get(key)]
    if not caches:
        live = reference["live_model"]
        what = "; with `--use-peft` it is the policy itself with its adapter disabled" if peft else ""
        if isinstance(live.get("layout"), dict):  # --ref-device-map: the reference was split across devices
            from runtime.placement import describe

            what += f"; split by {describe(live['layout'])}"
        return (f"A live reference model, no cache: {_named(live)}, model hash `{live.get('model_hash')}`, scored "
                f"beside the policy at every step{what}.")
    rows = [["path"] + [_code(c.get("path")) for _, c in caches],
            ["reference model"] + [_code(_cache_model(c)) for _, c in caches],
            ["version"] + [c.get("version") for _, c in caches],
            ["cache_id"] + [_code(c.get("cache_id")) for _, c in caches],
            ["manifest.json sha256"] + [_code(c.get("manifest_sha256")) for _, c in caches]]
    stamps = sorted({k for _, c in caches for k in (c.get("stamps") or {})})
    rows += [[f"stamp `{k}`"] + [_code((c.get("stamps") or {}).get(k)) for _, c in caches] for k in stamps]
    return ("Reference log-probs from refcache caches, verified before training (the stamps: the reference's model "
            "hash, the tokenizer hash and the checksum of every row's token masks; the cache_id: stamps, encoding and "
            "shard files):\n\n" + _table([""] + [f"{role} cache" for role, _ in caches],
                                   [r for r in rows if any(v is not None for v in r[1:])])
            + (f"\n\nThe train cache: {line}." if (line := _version_line(reference)) else ""))


def _version_line(reference: dict) -> str | None:
    """The train cache's version as train-dpo verified it (schemas/history.py version_line, in the run manifest)."""
    version = (reference.get("verification") or {}).get("version")
    return version.get("line") if isinstance(version, dict) else None


def reference_section(reference: dict, peft: dict | None = None) -> str:
    """The card's reference section (markdown) of a run manifest's `reference`: also written by dpo/trl.py into the
    card of a TRL DPOTrainer run."""
    return _reference(reference, peft)


def _cache_model(record: dict) -> str | None:
    """The reference model a cache names in its manifest (hub id, else path; recorded there, not verified), as the
    run manifest's cache record holds it; for a record written before it did, read from the cache's manifest.json
    wherever it lives (a folder or a store, storage/places.py)."""
    model = record.get("model")
    if not isinstance(model, dict):
        from storage.faults import StoreUnavailable
        from storage.places import location

        try:
            model = json.loads((location(record.get("path")) / "manifest.json").read_text(encoding="utf-8"))
            model = model.get("model") or {}
        except (OSError, ValueError, TypeError, AttributeError, StoreUnavailable):
            return None
    return (model.get("hub_id") or model.get("path")) if isinstance(model, dict) else None


def _options(config: dict, result: dict, peft: dict | None, kl: dict | None = None) -> str:
    rows = [[_code(k), _code(config.get(k))] for k in OPTIONS if k in config and _applies(k, config)]
    if kl:  # β governed over the run (dpo/kl_governor.py): the rule, its settings, where it ended, its alarms
        s = kl.get("settings") or {}
        rule = (f"{s.get('controller')} controller on {s.get('controlled')}" if s.get("controller")
                else f"{s.get('schedule')} schedule of {s.get('controlled')}")
        shown = {k: v for k, v in s.items() if v is not None and k not in ("controller", "controlled")}
        rows += [[_code("kl_control"), f"{rule}: {', '.join(f'{k} {v}' for k, v in shown.items())}"],
                 [_code(f"final {s.get('controlled')}"), _code(kl.get("final"))],
                 [_code("kl alarms"), f"{len([e for e in kl.get('alarms') or [] if e.get('event') == 'kl_alarm'])}, "
                                      f"rollbacks {kl.get('rollbacks', 0)}"]]
    rows += [[_code(k), _code(v)] for k, v in sorted((config.get("training_args") or {}).items())]
    rows += [[_code("world_size"), _code(result.get("world_size"))], [_code("batch_layout"),
                                                                      _code(result.get("batch_layout"))]]
    if peft:
        from .lora import DEFAULT_TARGETS

        options = peft.get("options") or {}
        rows += [[_code(k), _code(options.get(k))] for k in LORA_OPTIONS]
        rows.append([_code("lora_target_modules"), _code(options.get("lora_target_modules") or DEFAULT_TARGETS)])
    return _table(["option", "value"], rows)


def _applies(option: str, config: dict) -> bool:
    """A loss option at the value that switches it off, or one the run's loss does not read (dpo/loss_config.py's
    registry), says nothing about this run."""
    from .loss_config import LOSSES, unread_options

    if config.get("loss_type") in LOSSES and unread_options(config["loss_type"], [option]):
        return False
    return option not in OFF or config.get(option) != OFF[option]


def _results(manifest: dict, records: list[dict]) -> str:
    result = manifest.get("result") or {}
    train = next((r for r in reversed(records) if "loss" in r and not any(k.startswith("eval_") for k in r)), {})
    # the last evaluation as metrics.jsonl logged it (with its step), else as the run manifest has it
    final_eval = next((r for r in reversed(records) if "eval_loss" in r), None) or result.get("eval") or {}
    evals = {k.removeprefix("eval_"): v for k, v in final_eval.items() if k.startswith("eval_")
             and not k.endswith(("runtime", "per_second"))}
    keys = [k for k in train if k not in METRIC_SKIP] + [k for k in evals if k not in train]
    at = f" (step {final_eval['step']})" if "step" in final_eval else ""
    header = ["metric", f"train (step {train.get('step')})"] + ([f"eval{at}"] if evals else [])
    rows = [[k, _number(train.get(k))] + ([_number(evals.get(k))] if evals else []) for k in keys]
    peft = manifest.get("peft")
    hashes = ([f"adapter hash `{peft.get('final_adapter_hash')}`"] if peft else []) + (
        [f"{'merged ' if peft else ''}model hash `{manifest['final_model_hash']}`"]
        if manifest.get("final_model_hash") else [])
    text = f"{result.get('steps')} steps; {', '.join(hashes)}."
    return text + ("\n\n" + _table(header, rows) if rows else "")


def _number(v) -> str | None:
    return f"{v:.4g}" if isinstance(v, float) else None if v is None else str(v)


def _usage(kind: str, base: dict, peft: dict | None) -> str:
    if kind == "adapter" and not (peft or {}).get("init_adapter"):
        return ('from peft import AutoPeftModelForCausalLM\n\n'
                'model = AutoPeftModelForCausalLM.from_pretrained("PATH_TO_THIS_FOLDER")  # loads the base it names')
    if kind == "adapter":
        return ("from peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n\n"
                f'base = AutoModelForCausalLM.from_pretrained("{base.get("hub_id") or Path(base["path"]).resolve()}")\n'
                f'base = PeftModel.from_pretrained(base, "{peft["init_adapter"]["path"]}").merge_and_unload()\n'
                'model = PeftModel.from_pretrained(base, "PATH_TO_THIS_FOLDER")')
    return ("from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            'model = AutoModelForCausalLM.from_pretrained("PATH_TO_THIS_FOLDER")\n'
            'tokenizer = AutoTokenizer.from_pretrained("PATH_TO_THIS_FOLDER")')


def _software(software: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in software.items())
