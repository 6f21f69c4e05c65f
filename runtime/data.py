"""Loading preference data with `datasets`, and encoding it through the schemas encoder.

Both precompute-ref and train-dpo load and encode data here, so a row's id and ids are the same on both sides. Which
files a data set is (its split, its dataset card's config) is decided in runtime/data_files.py.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from schemas.chat_template import ChatTemplateError
from schemas.encoding import EncodedPair, EncodingConfig, column_pairs, encode_pair, rename_columns, row_id
from schemas.rows import BadRowError

from .data_files import SUFFIXES, DataError, _data_files, _loader_quiet, _split_named, card_configs
from .errors import JobError


@dataclass
class Source:
    """Rows with where each came from."""

    rows: list[dict]
    locations: list[tuple[str, int]]  # (file, 1-based row number)
    files: list[str]
    config: str | None = None  # the dataset card's config that chose the files (None: no card configs)

    @property
    def fingerprint(self) -> str:
        """Content fingerprint of the rows in order, independent of the container format."""
        h = hashlib.sha256(b"refcache-data-v1")
        for r in self.rows:
            h.update(json.dumps(r, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8") + b"\n")
        return h.hexdigest()


def _check_utf8(path: Path) -> None:
    """Name the first line of a text file that is not UTF-8 (the loaders only say that generation failed)."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(path, None, f"line {n} is not valid UTF-8 ({e.reason}: byte 0x{raw[e.start]:02x} at "
                                         f"column {e.start + 1}); save the file as UTF-8") from None


def _csv_features(path: Path, params: dict | None = None):
    """Every CSV column read as text: '4' is an answer, not a number (`params`: a card's loader settings, its
    separator)."""
    import csv

    import datasets

    params = params or {}
    with open(path, newline="", encoding="utf-8") as f:
        header = next(csv.reader(f, delimiter=params.get("sep", params.get("delimiter", ","))), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


@dataclass(frozen=True)
class Unparsable:
    """A JSON Lines line that is not valid JSON, kept in its place so `on_bad_row` decides what becomes of it."""

    detail: str


def _is_json_lines(path: Path) -> bool:
    """A .json/.jsonl file that is not one JSON array is read as JSON Lines."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                return not raw.lstrip().startswith(b"[")
    return True


def _line_numbers(path: Path) -> list[int]:
    with open(path, "rb") as f:
        return [n for n, raw in enumerate(f, 1) if raw.strip()]


def _read_json_lines(path: Path) -> tuple[list, list[int]]:
    """Parse a JSON Lines file ourselves (when `datasets` refuses it): unparsable lines become `Unparsable` rows and
    missing keys are filled with None, as `datasets` does."""
    rows, numbers = [], []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rows.append(json.loads(raw.rstrip(b"\r\n").decode("utf-8")))
            except UnicodeDecodeError as e:
                rows.append(Unparsable(f"invalid UTF-8 ({e.reason} at byte {e.start} of the line)"))
            except json.JSONDecodeError as e:  # its own "line 1" is the line's; the row is the line
                rows.append(Unparsable(f"unparsable JSON ({e.msg} at column {e.colno})"))
            except ValueError as e:
                rows.append(Unparsable(f"unparsable JSON ({e})"))
            numbers.append(n)
    keys = dict.fromkeys(k for r in rows if isinstance(r, dict) for k in r)
    return [{k: r.get(k) for k in keys} if isinstance(r, dict) else r for r in rows], numbers


def _load_file(path: Path, params: dict | None = None) -> tuple[list, list[int]]:
    """A file's rows and their 1-based row numbers (the line number for JSON Lines); `params`: the loader settings
    a dataset card's config gives (passed to datasets' loader as load_dataset passes them)."""
    import datasets

    kind = SUFFIXES[path.suffix]
    json_lines = kind == "json" and _is_json_lines(path) and not params
    if kind == "csv":
        _check_utf8(path)
    try:
        extra = {"features": _csv_features(path, params)} if kind == "csv" else {}
        extra |= params or {}
        with _loader_quiet():
            ds = datasets.load_dataset(kind, data_files=str(path), split="train", **extra)
    except Exception as e:  # datasets wraps parser errors in several types; locate the row ourselves when we can
        if json_lines:
            return _read_json_lines(path)
        if kind == "json":
            try:
                json.loads(path.read_bytes())
            except ValueError as bad:
                raise DataError(path, None, f"unparsable JSON ({bad})") from None
        raise DataError(path, None, f"could not be loaded: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
    try:
        rows = ds.to_list()
    except UnicodeDecodeError as e:  # the Arrow JSON reader lets bytes that are not UTF-8 into string columns
        if json_lines:
            return _read_json_lines(path)  # names the line
        raise DataError(path, None, f"invalid UTF-8 ({e.reason} at byte {e.start} of a value)") from None
    numbers = _line_numbers(path) if json_lines else []
    return rows, numbers if len(numbers) == len(rows) else list(range(1, len(rows) + 1))


def load_rows(path, split: str = "train", config: str | None = None) -> Source:
    """Rows from a file, a directory of files (with a dataset card, the files its config `config` chooses), or a
    `datasets.save_to_disk` directory."""
    import datasets

    from .hub import resolve_data

    path = Path(resolve_data(str(path)))
    if not path.exists():
        from storage.nearby import not_here

        raise DataError(path, None, not_here(path))
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        if config is not None:
            raise DataError(path, None, f"--data-config {config!r}: a save_to_disk folder has no configs; leave "
                                        "--data-config out")
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            split = _split_named(split, ds)
            if split not in ds:
                raise DataError(path, None, f"no split {split!r}; available: {sorted(ds)}")
            ds = ds[split]
        rows = ds.to_list()
        return Source(rows, [(str(path), i + 1) for i in range(len(rows))], [str(path)])
    rows, locations, files = [], [], []
    selection = _data_files(path, split, config)
    for file in selection.files:
        part, numbers = _load_file(file, selection.params)
        rows += part
        locations += [(str(file), n) for n in numbers]
        files.append(str(file))
    if not rows:
        raise DataError(path, None, "no rows")
    return Source(rows, locations, files, selection.config)


def recorded_config(data, manifest: dict) -> str | None:
    """The dataset card config a cache's rows were read with (its manifest's `source.config`, precompute-ref
    --data-config or the card's default), so that train-dpo and audit-ref read `data` as the cache did; None when the
    cache records none or `data` is not a folder whose card has configs (then the names choose the files)."""
    from .hub import resolve_data

    source = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
    config = source.get("config")
    if not isinstance(config, str) or data is None:
        return None
    path = Path(resolve_data(str(data)))
    return config if path.is_dir() and card_configs(path) is not None else None


@dataclass
class Encoded:
    """The encodable rows of a source, in order, and the ones that were not."""

    ids: list[str]
    pairs: list[EncodedPair]
    skipped: list[dict] = field(default_factory=list)  # {"file", "row", "id", "reason", "detail"}
    identical: int = 0  # pairs whose chosen and rejected completions encode identically
    formats: Counter = field(default_factory=Counter)  # standard / conversational / implicit rows encoded

    @property
    def templated(self) -> bool | None:
        """Whether the rows are conversational (rendered with the chat template under chat_template=auto)."""
        return None if not self.formats else self.formats.get("conversational", 0) > 0

    @property
    def skipped_by_reason(self) -> dict[str, int]:
        return dict(sorted(Counter(s["reason"] for s in self.skipped).items()))


def _clean(row: dict) -> dict:
    """Drop null extra columns; a null prompt/chosen/rejected stays, to be reported as missing."""
    return {k: v for k, v in row.items() if v is not None or k in ("prompt", "chosen", "rejected")}


def row_format(row: dict) -> str:
    """TRL's name for a row's format."""
    if isinstance(row.get("chosen"), list):
        return "conversational"
    return "standard" if "prompt" in row else "implicit"


def check_columns(source: Source, columns: str | None) -> None:
    """The column mapping (EncodingConfig.columns) against each file's columns: every mapped column present, and no
    column kept under a name the mapping gives another one. A file that does not fit is refused as a whole, naming
    the file and the column (never a skip of every row)."""
    if not columns:
        return
    mapping = column_pairs(columns)
    keys: dict[str, dict] = {}
    for row, (file, _n) in zip(source.rows, source.locations):
        if isinstance(row, dict):
            keys.setdefault(file, {}).update(dict.fromkeys(row))
    for file, present in keys.items():
        for target, column in mapping.items():
            if column not in present:
                raise DataError(file, None, f"no column {column!r} (--columns {target}={column}); its columns: "
                                            f"{', '.join(map(str, present))}")
        clash = [t for t in mapping if t in present and t not in mapping.values()]
        if clash:
            raise DataError(file, None, f"it has a column {clash[0]!r} and --columns maps {mapping[clash[0]]!r} to "
                                        f"{clash[0]}, so one of them would be dropped; map {clash[0]!r} to another "
                                        "name or leave it out of --columns")


def _columns_hint(error: BadRowError, config: EncodingConfig) -> str:
    if config.columns:
        return f" (--columns {config.columns})"
    if error.reason == "missing_field":
        return "; if the data names it otherwise, map it with --columns (e.g. --columns chosen=COLUMN)"
    return ""


def encode_rows(source: Source, tokenizer, config: EncodingConfig, on_bad_row: str = "error") -> Encoded:
    """Encode every row (under the encoder's column names: config.columns); bad rows raise DataError
    (on_bad_row='error') or are listed in `skipped`."""
    out = Encoded([], [])
    seen: dict[str, tuple[str, int]] = {}
    check_columns(source, config.columns)
    for row, (file, n) in zip(source.rows, source.locations):
        row = rename_columns(row, config.columns)
        row = _clean(row) if isinstance(row, dict) else row
        rid = None
        try:
            rid = row_id(row) if isinstance(row, dict) else None
            if isinstance(row, Unparsable):
                raise BadRowError("bad_json", row.detail)
            if rid in seen:
                raise BadRowError("duplicate_id", f"id {rid!r} already used at {seen[rid][0]}, row {seen[rid][1]}")
            pair = encode_pair(row, tokenizer, config)
        except ChatTemplateError as e:  # the template itself, not this row: no row can be encoded
            raise JobError(str(e)) from None
        except BadRowError as e:
            if on_bad_row == "error":
                raise DataError(file, n, str(e) + _columns_hint(e, config)) from None
            out.skipped.append({"file": file, "row": n, "id": rid, "reason": e.reason, "detail": e.detail})
            continue
        seen[rid] = (file, n)
        out.formats[row_format(row)] += 1
        out.ids.append(rid)
        out.pairs.append(pair)
        out.identical += pair.chosen_ids == pair.rejected_ids
    return out


def usable_rows(source: Source, tokenizer, config: EncodingConfig, on_bad_row: str, data) -> Encoded:
    """`encode_rows` for a job that needs rows: none left (an empty data set, or every row bad and skipped) is
    refused naming `data` (the --data / --eval-data value) and the skip counts."""
    encoded = encode_rows(source, tokenizer, config, on_bad_row)
    if not encoded.pairs:
        raise DataError(data, None, f"no usable rows ({len(encoded.skipped)} skipped: {encoded.skipped_by_reason})")
    return encoded
