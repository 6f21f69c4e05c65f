"""A cache's dataset card: README.md beside manifest.json, with Hugging Face dataset-card metadata, rendered from the
manifest by huggingface_hub (`DatasetCard`, `DatasetCardData`). Its `configs` metadata names the manifest's shards
one by one, so `datasets.load_dataset(CACHE_DIR)` reads the rows and nothing else of the folder (the columns whose
stored form is their value: a top-k cache's top-k columns are read with `schemas.to_dataset` / `read_cache`); its
`refcache` metadata is the manifest's identity (format version, cache_id, stamps, encoding, computation, counts), and
its text says the same for people, with how to use the cache.

The card is derived from the manifest and never the other way round: it is not part of the cache's identity
(cache_id and the stamps do not cover it), train-dpo's reader does not read it, and a cache without one (made before
cards) is as good. precompute-ref writes it after the manifest, from the manifest that stays in the folder, and
only when its bytes would change (a no-op rerun changes no file). audit-ref's `card` check compares its metadata with
the manifest (rules.card_findings). Nothing here reads or writes the card's text beyond rendering it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from storage import places, writes

from . import format as fmt
from . import history
from .stamps import cache_id

SPLIT_NAME = re.compile(r"^\w+(\.\w+)*$")  # what `datasets` accepts as a split name
TAGS = ["refcache", "dpo", "reference-log-probs"]
SIZES = [(1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
         (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M"), (1_000_000_000, "100M<n<1B")]
DEFINED = ("configs", "refcache")  # the metadata refcache defines (and audit-ref compares); the rest is free


def split_of(manifest: dict) -> str:
    """The split the card names: the data split the cache was made from, or `train` when `datasets` would not take
    that name as a split."""
    split = (manifest.get("source") or {}).get("split") if isinstance(manifest.get("source"), dict) else None
    return split if isinstance(split, str) and SPLIT_NAME.match(split) else "train"


def card_metadata(manifest: dict) -> dict:
    """The card metadata refcache defines (DEFINED), from a manifest that `format.read_manifest` accepted."""
    shards = [e["file"] for e in manifest["shards"]]
    identity = {"format_version": manifest["format_version"], "cache_id": cache_id(manifest),
                "stamps": {k: manifest["stamps"][k] for k in fmt.STAMPS}, "encoding": manifest["encoding"],
                "computation": manifest.get("computation"), "top_k": fmt.top_k_of(manifest.get("computation")),
                "rows": sum(e["rows"] for e in manifest["shards"]), "shards": len(shards),
                "version": history.version_of(manifest)}
    # file names, not a glob: the shards and only they, whatever else the folder holds
    configs = [{"config_name": "default", "data_files": [{"split": split_of(manifest), "path": shards}]}]
    # a top-k cache's tails too: the reader normalises them with the top-k log-probs (format.normalised_top_k)
    stored = [c.name for c in fmt.shard_columns(identity["top_k"])
              if c.physical is None and not (identity["top_k"] and c.name.endswith("_tail"))]
    if len(stored) < len(fmt.shard_columns(identity["top_k"])):  # (a cache without top-k: every column, as before)
        configs[0]["columns"] = stored  # `datasets` reads files as stored: never a storage code under a value's name
    return {"configs": configs, "refcache": identity}


def dataset_card(manifest: dict):
    """The card of a manifest (a huggingface_hub DatasetCard): a function of the manifest alone (its version line
    says when the version was made: a rerun that changes nothing keeps the manifest, and so the card, as they are),
    without with which software or from which paths it was made."""
    from huggingface_hub import DatasetCard, DatasetCardData

    rows = sum(e["rows"] for e in manifest["shards"])
    data = DatasetCardData(pretty_name=f"refcache reference log-probs of {_model_name(manifest)} "
                                       f"({split_of(manifest)} split)",
                           tags=TAGS, size_categories=[_size(rows)], **card_metadata(manifest))
    return DatasetCard(f"---\n{data.to_yaml()}\n---\n\n{_text(manifest)}")


def write_card(root: Path, manifest: dict) -> bool:
    """Write `root`/README.md for `manifest` (atomically, never through a link) unless it already holds exactly that;
    True when written."""
    path = places.location(root) / fmt.CARD
    data = str(dataset_card(manifest)).encode("utf-8")
    if path.is_file() and not path.is_symlink() and path.read_bytes() == data:
        return False
    writes.write_whole(path, lambda f: f.write(data))
    return True


def read_card_metadata(path: Path) -> dict | None:
    """A README.md's card metadata (huggingface_hub's parser), or None when it is not a readable card."""
    from huggingface_hub import DatasetCard

    try:
        if places.is_remote(path):
            return DatasetCard(path.read_text()).data.to_dict()
        return DatasetCard.load(Path(path)).data.to_dict()
    except Exception:  # not UTF-8, bad YAML, a metadata block that is not a mapping: not a card
        return None


def _model_name(manifest: dict) -> str:
    model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    name = model.get("name") if isinstance(model.get("name"), str) else "a reference model"
    return name + (f" + adapter {Path(model['adapter']).name}" if isinstance(model.get("adapter"), str) else "")


def _size(rows: int) -> str:
    return next((label for bound, label in SIZES if rows < bound), "1B<n<10B")


def _mapping(value) -> dict:
    """A section of the manifest the rules do not judge (source, its counts): what it says if it is a mapping, else
    nothing. The card is rendered from whatever manifest.json holds and must not fail on it; audit-ref judges it."""
    return value if isinstance(value, dict) else {}


def _table(values) -> str:
    if not isinstance(values, dict):  # a manifest read as it is, before any rule judged it: the card says what it holds
        values = {"(not a mapping)": values}
    lines = ["| key | value |", "|---|---|"]
    cell = lambda v: (v if isinstance(v, str) else json.dumps(v)).replace("|", "\\|")  # a table cell holds no |
    lines += [f"| `{k}` | `{cell(v)}` |" for k, v in sorted(values.items())]
    return "\n".join(lines)


def _use(split: str) -> str:
    """train-dpo's options that take this cache: its training cache, or the eval cache of a held-out split."""
    if split == "train":
        return "--ref-cache path/to/this/cache"
    return f"--ref-cache TRAIN_CACHE --eval-data DATA --eval-split {split} --eval-ref-cache path/to/this/cache"


def _text(manifest: dict) -> str:
    meta = card_metadata(manifest)["refcache"]
    split, stamps, top_k = split_of(manifest), meta["stamps"], meta["top_k"]
    source = _mapping(manifest.get("source"))
    counts = {"rows": meta["rows"], "shards": meta["shards"], "bytes": sum(e["bytes"] for e in manifest["shards"])}
    counts |= {k: source[k] for k in ("rows_in", "skipped", "identical_pairs") if k in source}
    counts |= {f"skipped: {k}": v for k, v in _mapping(source.get("skipped_by_reason")).items()}
    counts |= {f"rows in TRL format {k}": v for k, v in _mapping(source.get("formats")).items()}
    columns = "\n".join(f"- `{c.name}`: {c.stored}" + (f" (stored form of {c.logical}: read it with "
                                                        "`read_cache` or `to_dataset`)" if c.physical else "")
                        for c in fmt.shard_columns(top_k))
    stored_note = (" (without the top-k columns, whose\n# stored form is not their value: read them with read_cache or "
                   "to_dataset)") if top_k else ""
    return f"""# Reference log-probs of {_model_name(manifest)} ({split} split)

A refcache cache: the per-token log-probs of a frozen reference model on a preference data set,
written once by `precompute-ref`, so that `train-dpo --ref-cache` trains DPO without loading the reference. Each row is
a preference pair: its id, the token ids of its prompt and completions, and one reference log-prob per completion
token{f", with the reference's {top_k} most probable tokens at each position" if top_k else ""}.

## Stamps

What train-dpo and audit-ref compare before they use a row (`manifest.json` is the authority; this card is rendered
from it and is not part of the cache's identity).

| stamp | value |
|---|---|
| model hash | `{stamps["model_hash"]}` |
| tokenizer hash | `{stamps["tokenizer_hash"]}` |
| mask checksum | `{stamps["mask_checksum"]}` |
| cache id | `{meta["cache_id"]}` |
| data fingerprint | `{source.get("fingerprint")}` |
| file format | `{meta["format_version"]}` |

## Version

{history.version_line(manifest)}. `precompute-ref --update` brings the cache to grown, shrunk or edited data as a new
version; each earlier version's manifest is kept as `manifest-NNNNN.json`, and `train-dpo --cache-version N` or
`audit-ref --cache-version N` reads that version.

## Encoding

How each pair was turned into token ids (`schemas/encoding.py`'s `encode_pair`):

{_table(manifest["encoding"])}

## Computation

What scored the rows (batching mode, dtype, device, attention, top-k, ...):

{_table(manifest.get("computation") or {})}

## Counts

{_table(counts)}

## Columns

Parquet shards (zstd), listed in `manifest.json` in row order; the card's `configs` name each of them, so that
`datasets` reads only them:

{columns}

## Use

```python
from datasets import load_dataset
rows = load_dataset("path/to/this/cache", split="{split}")  # the shards as stored, not verified{stored_note}
from schemas import read_cache, to_dataset
rows = read_cache("path/to/this/cache")  # a polars LazyFrame of every column's values, after verifying the cache
rows = to_dataset("path/to/this/cache")  # the same as a datasets.Dataset
```

Read the shards through `manifest.json` (or these readers), never with a `*.parquet` glob: after
`precompute-ref --update` the folder also holds the shards of earlier versions.

```bash
# DPO against this reference, on the data it was made from
train-dpo --model POLICY --data DATA {_use(split)} --output-dir run
# re-verify the cache, and replay the reference on a sample of rows
audit-ref path/to/this/cache --model REFERENCE_MODEL
```

train-dpo refuses the cache when its model, tokenizer, encoding or rows differ from those stamped here.
"""
