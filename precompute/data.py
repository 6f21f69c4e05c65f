"""Loading preference data with `datasets`, and encoding it through the schemas encoder.

Both precompute-ref and train-dpo load and encode data here, so a row's id and ids are the same on both sides.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from schemas.encoding import BadRowError, EncodedPair, EncodingConfig, encode_pair, row_id

SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    """Unusable input data: names the file, the row (1-based line or record number) and the reason."""

    def __init__(self, file, row, reason):
        where = f"{file}" + (f", row {row}" if row is not None else "")
        super().__init__(f"{where}: {reason}")
        self.file, self.row, self.reason = str(file), row, reason


@dataclass
class Source:
    """Rows with where each came from."""

    rows: list[dict]
    locations: list[tuple[str, int]]  # (file, 1-based row number)
    files: list[str]

    @property
    def fingerprint(self) -> str:
        """Content fingerprint of the rows in order, independent of the container format."""
        h = hashlib.sha256(b"refcache-data-v1")
        for r in self.rows:
            h.update(json.dumps(r, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8") + b"\n")
        return h.hexdigest()


def _data_files(path: Path, split: str) -> list[Path]:
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise DataError(path, None, f"unsupported file type {path.suffix!r}; use .jsonl, .json, .parquet or .csv")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
    named = [p for p in files if p.stem == split or p.stem.startswith(split + "-") or p.parent.name == split]
    if named:
        return named
    if not files:
        raise DataError(path, None, "no .jsonl, .json, .parquet or .csv files found")
    return files


def _scan_json_lines(path: Path) -> None:
    """Find the first unparsable line of a JSON Lines file to name it in the error."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(path, n, f"invalid UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as e:
                raise DataError(path, n, f"unparsable JSON ({e})") from None
            if not isinstance(value, dict):
                raise DataError(path, n, f"expected a JSON object, found {type(value).__name__}")


def _load_file(path: Path, split_name: str):
    import datasets

    kind = SUFFIXES[path.suffix]
    try:
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as e:  # datasets wraps parser errors in several types; locate the row ourselves when we can
        if kind == "json":
            _scan_json_lines(path)
        raise DataError(path, None, f"could not be loaded: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
    return ds


def load_rows(path, split: str = "train") -> Source:
    """Rows from a file, a directory of files, or a `datasets.save_to_disk` directory."""
    import datasets

    path = Path(path)
    if not path.exists():
        raise DataError(path, None, "no such file or directory")
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(path, None, f"no split {split!r}; available: {sorted(ds)}")
            ds = ds[split]
        rows = ds.to_list()
        return Source(rows, [(str(path), i + 1) for i in range(len(rows))], [str(path)])
    rows, locations, files = [], [], []
    for file in _data_files(path, split):
        ds = _load_file(file, split)
        part = ds.to_list()
        rows += part
        locations += [(str(file), i + 1) for i in range(len(part))]
        files.append(str(file))
    if not rows:
        raise DataError(path, None, "no rows")
    return Source(rows, locations, files)


@dataclass
class Encoded:
    """The encodable rows of a source, in order, and the ones that were not."""

    ids: list[str]
    pairs: list[EncodedPair]
    skipped: list[dict] = field(default_factory=list)  # {"file", "row", "id", "reason", "detail"}
    identical: int = 0  # pairs whose chosen and rejected completions encode identically

    @property
    def skipped_by_reason(self) -> dict[str, int]:
        return dict(sorted(Counter(s["reason"] for s in self.skipped).items()))


def _clean(row: dict) -> dict:
    """Drop null extra columns; a null prompt/chosen/rejected stays, to be reported as missing."""
    return {k: v for k, v in row.items() if v is not None or k in ("prompt", "chosen", "rejected")}


def encode_rows(source: Source, tokenizer, config: EncodingConfig, on_bad_row: str = "error") -> Encoded:
    """Encode every row; bad rows raise DataError (on_bad_row='error') or are listed in `skipped`."""
    out = Encoded([], [])
    seen: dict[str, tuple[str, int]] = {}
    for row, (file, n) in zip(source.rows, source.locations):
        row = _clean(row) if isinstance(row, dict) else row
        rid = row_id(row) if isinstance(row, dict) else None
        try:
            if rid in seen:
                raise BadRowError("duplicate_id", f"id {rid!r} already used at {seen[rid][0]}, row {seen[rid][1]}")
            pair = encode_pair(row, tokenizer, config)
        except BadRowError as e:
            if on_bad_row == "error":
                raise DataError(file, n, str(e)) from None
            out.skipped.append({"file": file, "row": n, "id": rid, "reason": e.reason, "detail": e.detail})
            continue
        seen[rid] = (file, n)
        out.ids.append(rid)
        out.pairs.append(pair)
        out.identical += pair.chosen_ids == pair.rejected_ids
    return out
