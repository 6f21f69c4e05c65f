"""The three stamps every cache carries: tokenizer hash, model hash and mask checksum.

Each stamp is a sha256 hex digest over a canonical form, so it is stable across save/load round trips, processes
and machines, and changes when anything that could change the cached numbers changes.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from pathlib import Path

# config.json fields that describe the file or the runtime, not what the model computes.
CONFIG_FIELDS_IGNORED = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "transformers_version",
        "torch_dtype",
        "dtype",  # the tensors' own dtypes are hashed
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "architectures",
        "auto_map",
    }
)


class WeightsError(ValueError):
    """A checkpoint whose weights cannot be hashed (no safetensors, a broken header, a path leaving the folder)."""


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


# ---------------------------------------------------------------------------------------------------------------
# tokenizer hash


def tokenizer_fingerprint(tokenizer) -> dict:
    """Everything about a tokenizer that can change the ids `encode_pair` produces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"{type(tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer; refcache needs one")
    spec = json.loads(backend.to_str())
    spec.pop("truncation", None)  # runtime settings, reset on every load
    spec.pop("padding", None)
    specials = {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return {
        "backend": spec,
        "special_tokens": {k: (str(v) if v is not None else None) for k, v in specials.items()},
        "chat_template": getattr(tokenizer, "chat_template", None),
    }


TOKENIZER_PARTS = ("vocab", "merges", "model", "normalizer", "pre_tokenizer", "post_processor", "decoder",
                   "added_tokens", "special_tokens", "chat_template")


def tokenizer_parts(tokenizer) -> dict[str, str]:
    """A short hash of each part of the fingerprint, recorded beside the tokenizer hash so that a mismatch can say
    what differs (vocab, merges, special tokens, chat template, normaliser, ...)."""
    fp = tokenizer_fingerprint(tokenizer)
    backend = dict(fp["backend"])
    model = dict(backend.pop("model", None) or {})
    values = {"vocab": model.pop("vocab", None), "merges": model.pop("merges", None), "model": model,
              **{k: backend.get(k) for k in ("normalizer", "pre_tokenizer", "post_processor", "decoder",
                                             "added_tokens")},
              "special_tokens": fp["special_tokens"], "chat_template": fp["chat_template"]}
    return {k: hashlib.sha256(_canonical(values[k])).hexdigest()[:16] for k in TOKENIZER_PARTS}


def tokenizer_hash(tokenizer) -> str:
    return hashlib.sha256(b"refcache-tokenizer-v1" + _canonical(tokenizer_fingerprint(tokenizer))).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# model hash


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The checkpoint's safetensors files, refusing pickle-only checkpoints and paths that leave the folder."""
    root = Path(model_dir).resolve()
    if not root.is_dir():
        raise WeightsError(f"{model_dir}: not a directory holding a Hugging Face checkpoint")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        # Judge the names as written, without following symlinks: a Hugging Face hub snapshot holds every file as a
        # symlink into ../../blobs, which is fine; a name such as '../x' or '/abs/x' is not.
        files = [Path(os.path.normpath(root / n)) for n in names]
        for n, f in zip(names, files):
            if f.parent != root:
                raise WeightsError(f"{index}: weight file {n!r} is outside the checkpoint folder")
            if not f.is_file():
                raise WeightsError(f"{index}: lists {n!r}, which does not exist")
        return files
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    if files:
        return files
    pickles = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
    if pickles:
        raise WeightsError(
            f"{model_dir}: only pickle weights ({', '.join(pickles)}); refcache loads safetensors only. Convert with "
            "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)` in a trusted "
            "environment."
        )
    raise WeightsError(f"{model_dir}: no *.safetensors weight files found")


def _read_header(f, path: Path) -> tuple[dict, int]:
    raw = f.read(8)
    if len(raw) != 8:
        raise WeightsError(f"{path}: too short to be a safetensors file")
    (n,) = struct.unpack("<Q", raw)
    size = path.stat().st_size
    if n > size - 8 or n > 100 * 2**20:
        raise WeightsError(f"{path}: corrupt safetensors header (length {n})")
    try:
        header = json.loads(f.read(n))
    except ValueError as e:
        raise WeightsError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def model_config_fingerprint(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise WeightsError(f"{model_dir}: no config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # also UnicodeDecodeError
        raise WeightsError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{path}: not a JSON object")
    return {k: v for k, v in config.items() if k not in CONFIG_FIELDS_IGNORED}


def model_hash(model_dir: str | os.PathLike) -> str:
    """sha256 over every tensor (name, dtype, shape, bytes) in name order plus the behavioural config fields.

    Streams the safetensors files through mmap; the model is never built, and how the checkpoint is split into
    files does not matter.
    """
    tensors = {}  # name -> (file, dtype, shape, begin, end)
    for path in weight_files(model_dir):
        with open(path, "rb") as f:
            header, data_start = _read_header(f, path)
        for name, info in header.items():
            if name in tensors:
                raise WeightsError(f"{path}: tensor {name!r} also appears in {tensors[name][0].name}")
            begin, end = info["data_offsets"]
            tensors[name] = (path, info["dtype"], info["shape"], data_start + begin, data_start + end)
    h = hashlib.sha256(b"refcache-model-v1")
    h.update(_canonical(model_config_fingerprint(model_dir)))
    maps: dict[Path, mmap.mmap] = {}
    try:
        for name in sorted(tensors):
            path, dtype, shape, begin, end = tensors[name]
            if path not in maps:
                with open(path, "rb") as f:
                    maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if end > len(maps[path]) or begin > end:
                raise WeightsError(f"{path}: tensor {name!r} points past the end of the file (truncated?)")
            h.update(_canonical([name, dtype, shape, end - begin]))
            h.update(memoryview(maps[path])[begin:end])
    finally:
        for m in maps.values():
            m.close()
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# mask checksums of a shard or a whole cache (the per-row checksum lives in encoding.py beside the encoder)


def combined_mask_checksum(row_checksums, encoding_json: str) -> str:
    """Checksum of an ordered run of rows (a shard, or the whole cache in shard order) and the encoding config."""
    h = hashlib.sha256(b"refcache-masks-v1")
    h.update(encoding_json.encode("utf-8"))
    for c in row_checksums:
        h.update(bytes.fromhex(c))
    return h.hexdigest()


def file_sha256(path: str | os.PathLike, chunk: int = 8 * 2**20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
