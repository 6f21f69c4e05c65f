"""Which files a preference data set is, by `datasets`' own rules (runtime/data.py reads them): one file, or the files
of a split of a folder, chosen by its dataset card's config (README.md `configs`) when it has one, else by the file
and folder names; and `DataError`, unusable input data named by file, row and reason."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path


SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    """Unusable input data: names the file, the row (1-based line or record number) and the reason."""

    def __init__(self, file, row, reason):
        where = f"{file}" + (f", row {row}" if row is not None else "")
        super().__init__(f"{where}: {reason}")
        self.file, self.row, self.reason = str(file), row, reason


CARD = "README.md"  # a data set's card, whose `configs` choose its files as `datasets.load_dataset` reads them
CONFIG_KEYS = ("config_name", "data_files", "data_dir", "default")  # a card config's keys that choose files


@dataclass
class Selection:
    """The files of a split as `datasets` resolves them, with the dataset card's config that chose them and the
    loader settings it gives (e.g. a CSV `sep`)."""

    files: list[Path]
    config: str | None = None
    params: dict = field(default_factory=dict)


def card_configs(path: Path):
    """The `configs` of the dataset card in folder `path`, read as `datasets` reads them (MetadataConfigs), or None
    when there is no card or it has no configs (then files and folder names choose the splits)."""
    card = path / CARD
    if not card.is_file():
        return None
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    try:
        configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(card).data)
    except Exception as e:  # bad YAML, a configs entry datasets refuses: load_dataset fails on it too
        raise DataError(card, None, f"is not a dataset card datasets can read ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0][:300] if str(e) else 'no message'})") from None
    return configs or None


def _card_splits(path: Path, config: str | None, configs) -> tuple[str, dict, dict]:
    """(config name, {split: files}, loader settings) of the card config `config` (None: the card's default, as
    datasets picks it), resolved by datasets itself (load_dataset_builder: data_files, data_dir and split rules)."""
    import datasets

    names = ", ".join(configs)
    try:
        chosen = config if config is not None else configs.get_default_config_name()
    except ValueError as e:
        raise DataError(path / CARD, None, f"{e}; choose one with --data-config ({names})") from None
    if chosen is None:
        raise DataError(path, None, f"its dataset card ({CARD}) has {len(configs)} configs and none is the default: "
                                    f"choose one with --data-config (configs: {names}); train-dpo and audit-ref read "
                                    "the config their cache was made with")
    if chosen not in configs:
        raise DataError(path, None, f"no config {chosen!r} in its dataset card ({CARD}); configs: {names}")
    try:
        with _loader_quiet():
            builder = datasets.load_dataset_builder(str(path), chosen)
    except Exception as e:  # a pattern that matches no file, a data_dir that is not there
        raise DataError(path, None, f"config {chosen!r} of its dataset card ({CARD}) names no readable files "
                                    f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})") from None
    splits = {str(name): [Path(f) for f in files] for name, files in (builder.config.data_files or {}).items()}
    params = {k: v for k, v in configs[chosen].items() if k not in CONFIG_KEYS}
    return chosen, splits, params


def _data_files(path: Path, split: str, config: str | None = None) -> Selection:
    """The files of `split`, resolved by `datasets`' own rules: a folder whose dataset card (README.md) has
    `configs` reads the files of the chosen config (`config`, else the card's default) and no other; otherwise the
    file and folder names (train / test / eval / validation, or everything as `train` when no name says otherwise).
    An unknown split is an error listing the available ones, never every file."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    configs = card_configs(path) if path.is_dir() else None
    if config is not None and configs is None:
        raise DataError(path, None, f"--data-config {config!r}: it has no dataset card ({CARD}) with configs; "
                                    "leave --data-config out")
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise DataError(path, None, f"unsupported file type {path.suffix!r}; use .jsonl, .json, .parquet or .csv")
        return Selection([path])
    chosen, params = None, {}
    if configs is not None:
        chosen, splits, params = _card_splits(path, config, configs)
        for files in splits.values():  # a file the card chooses is read, or the whole data set is refused
            for f in files:
                if f.suffix not in SUFFIXES:
                    raise DataError(f, None, f"chosen by config {chosen!r} of the dataset card, but refcache reads "
                                             ".jsonl, .json, .parquet and .csv files only")
    else:
        try:
            patterns = get_data_patterns(str(path))
            splits = DataFilesDict.from_patterns(patterns, base_path=str(path), allowed_extensions=list(SUFFIXES))
        except FileNotFoundError:
            splits = {}
        splits = {str(name): [Path(f) for f in files if Path(f).suffix in SUFFIXES] for name, files in splits.items()}
    splits = {name: files for name, files in splits.items() if files}
    if not splits:
        raise DataError(path, None, "no .jsonl, .json, .parquet or .csv files found")
    split = _split_named(split, splits)
    if split not in splits:
        how = (f"as config {chosen!r} of its dataset card names them" if chosen is not None else
               "split names follow the file and folder names, as in datasets.load_dataset")
        raise DataError(path, None, f"no split {split!r}; available: {', '.join(sorted(splits))} ({how})")
    # the card's order is datasets' order; without a card, the names' (as before)
    return Selection(splits[split] if chosen is not None else sorted(splits[split]), chosen, params)


def _split_named(split: str, splits) -> str:
    """`split`, or the split that datasets files a file of that name under (eval.jsonl is split test, dev.jsonl
    validation), so that --split eval finds eval.jsonl."""
    from datasets.data_files import SPLIT_KEYWORDS

    if split in splits:
        return split
    return next((str(name) for name, words in SPLIT_KEYWORDS.items() if split in words and str(name) in splits),
                split)


def file_split(path) -> str:
    """The split a single data file is, by its name, as datasets files it in a folder (test.jsonl and eval.jsonl are
    test, dev.jsonl validation, anything else train): a file holds that one split and no other."""
    import re

    from datasets.data_files import NON_WORDS_CHARS, SPLIT_KEYWORDS

    name, sep = Path(str(path)).name.lower(), re.escape(NON_WORDS_CHARS)
    for split, words in SPLIT_KEYWORDS.items():
        if any(re.search(rf"(^|[{sep}]){re.escape(w)}([{sep}]|$)", name) for w in words):
            return str(split)
    return "train"


def split_of_file(data, split: str, given: bool, split_named: str, data_named: str) -> str:
    """The split the rows of `data` are when it is one local file: the file's own (file_split), so that what is
    recorded is what was read; a `split` given (`given`: on the command line or in --config) that names another is
    refused (exit 2), naming the option as given (`split_named`, `data_named`: runtime.locations.named) and why: a
    file holds one split, so the split would select nothing. `split` itself for a folder, a hub data set or a
    save_to_disk folder, where it selects."""
    from .errors import JobError

    if data is None or not Path(str(data)).is_file():
        return split
    own = file_split(data)
    if given and _split_named(split, {own}) != own:
        raise JobError(f"{split_named}{split}: {data_named}{data} is one file, which holds one split ({own}, by its "
                       f"name, as datasets names the files of a folder), so {split_named.strip().rstrip(':')} "
                       f"{split} would select nothing in it; leave it out (or give the file of split {split} as "
                       "the data, or a folder holding it)")
    return own


@contextlib.contextmanager
def _loader_quiet():
    """datasets logs its parser's failure (with a 0-based row of its own) before it raises; the error raised in its
    place here names the file, the 1-based line and the reason, alone."""
    from datasets.utils import logging as datasets_logging

    before = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    try:
        yield
    finally:
        datasets_logging.set_verbosity(before)
