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

from storage.reads import file_sha256, record_bytes

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


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def cache_id(manifest: dict) -> str:
    """A cache's identity: its content (stamps, encoding, and each shard file by name and sha256, in order), not the
    bytes of manifest.json, which also say when, by which software and from which paths it was made; a rerun that
    rewrites only those (a no-op rerun, --overwrite or a rescored shard giving the same files, another cwd) is the
    same cache, and a run trained on it still resumes and audits."""
    shards = [[e.get("file"), e.get("sha256")] for e in manifest.get("shards") or [] if isinstance(e, dict)]
    content = {"stamps": manifest.get("stamps"), "encoding": manifest.get("encoding"), "shards": shards}
    return hashlib.sha256(b"refcache-cache-id-v1" + canonical_json(content).encode("utf-8")).hexdigest()


def _canonical(obj) -> bytes:
    return canonical_json(obj).encode("utf-8")


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
    code = tokenizer_code(tokenizer)
    return {
        "backend": spec,
        "special_tokens": {k: (str(v) if v is not None else None) for k, v in specials.items()},
        "chat_template": getattr(tokenizer, "chat_template", None),
    } | ({"code": code} if code is not None else {})  # only then: a tokenizer without custom code keeps its hash


def tokenizer_code(tokenizer) -> list | None:
    """`code_digests` of the folder a tokenizer's custom class (auto_map, --trust-remote-code) was loaded from: that
    code can change the ids as much as the vocabulary can. None for a tokenizer of transformers' own classes."""
    if not any(c.__module__.startswith("transformers_modules") for c in type(tokenizer).__mro__):
        return None
    folder = Path(getattr(tokenizer, "name_or_path", None) or ".")
    for source in ("tokenizer_config.json", "config.json"):
        try:
            auto_map = json.loads(record_bytes(folder / source)).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue
        if auto_map:
            return code_digests(folder, auto_map, source)
    raise WeightsError(f"{folder}: the tokenizer's class {type(tokenizer).__name__} is custom code, but no auto_map "
                       "in the folder says which files it comes from; refcache cannot hash it")


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
    parts = TOKENIZER_PARTS + (("code",) if "code" in fp else ())
    values["code"] = fp.get("code")
    return {k: hashlib.sha256(_canonical(values[k])).hexdigest()[:16] for k in parts}


def tokenizer_hash(tokenizer) -> str:
    return hashlib.sha256(b"refcache-tokenizer-v1" + _canonical(tokenizer_fingerprint(tokenizer))).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# model hash


def _loaded_weights_file(root: Path, config: dict | None = None) -> tuple[Path | None, bool]:
    """The file `from_pretrained(root, use_safetensors=True)` opens and whether it is an index, by transformers' own
    resolution order (transformers 5.x `_get_resolved_checkpoint_files`, local folder, no variant): the config's
    `transformers_weights` if set, else `model.safetensors`, which wins over `model.safetensors.index.json`.
    `config`: root's config.json already parsed (read here when None)."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    if config is None and (root / "config.json").is_file():
        try:
            config = json.loads(record_bytes(root / "config.json"))
        except (ValueError, OSError):
            config = None  # model_config_fingerprint reports a broken config.json
    explicit = config.get("transformers_weights") if isinstance(config, dict) else None
    if isinstance(explicit, str):
        if not explicit.endswith((".safetensors", ".safetensors.index.json")):
            raise WeightsError(f"{root}: config.json transformers_weights {explicit!r} is not a safetensors file")
        return _inside(root, explicit, root / "config.json"), explicit.endswith(".index.json")
    for name, is_index in ((SAFE_WEIGHTS_NAME, False), (SAFE_WEIGHTS_INDEX_NAME, True)):
        if (root / name).is_file():
            return root / name, is_index
    return None, False


def _inside(root: Path, name: str, source: Path) -> Path:
    # Judge the names as written, without following symlinks: a Hugging Face hub snapshot holds every file as a
    # symlink into ../../blobs, which is fine; a name such as '../x' or '/abs/x' is not.
    path = Path(os.path.normpath(root / name))
    if path.parent != root:
        raise WeightsError(f"{source}: weight file {name!r} is outside the checkpoint folder")
    if not path.is_file():
        raise WeightsError(f"{source}: names {name!r}, which does not exist")
    return path


def weight_files(model_dir: str | os.PathLike, config: dict | None = None) -> list[Path]:
    """Exactly the safetensors files transformers loads from this folder (see `_loaded_weights_file`; `config`: its
    config.json when already parsed); refuses pickle-only checkpoints and names that leave the folder."""
    root = Path(model_dir).resolve()
    if not root.is_dir():
        raise WeightsError(f"{model_dir}: not a directory holding a Hugging Face checkpoint")
    loaded, is_index = _loaded_weights_file(root, config)
    if loaded is not None and not is_index:
        return [loaded]
    if loaded is not None:
        try:
            names = sorted(set(json.loads(loaded.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsError(f"{loaded}: not a safetensors index ({e})") from None
        return [_inside(root, n, loaded) for n in names]
    pickles = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
    if pickles:
        raise WeightsError(
            f"{model_dir}: only pickle weights ({', '.join(pickles)}); refcache loads safetensors only. Convert with "
            "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)` in a trusted "
            "environment."
        )
    others = sorted(p.name for p in root.glob("*.safetensors"))
    raise WeightsError(f"{model_dir}: no model.safetensors or model.safetensors.index.json, which is what "
                       "transformers loads" + (f" (found {', '.join(others[:3])})" if others else ""))


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


def _read_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise WeightsError(f"{model_dir}: no config.json")
    try:
        config = json.loads(record_bytes(path))
    except OSError as e:  # a FIFO, a device, a file larger than a config is (storage.reads.record_bytes)
        raise WeightsError(str(e)) from None
    except ValueError as e:  # also UnicodeDecodeError
        raise WeightsError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{path}: not a JSON object")
    return config


def model_config_fingerprint(model_dir: str | os.PathLike) -> dict:
    return config_fields(_read_config(model_dir))


def config_fields(config: dict) -> dict:
    """The behavioural part of a parsed config.json (what the model hash covers)."""
    return {k: v for k, v in config.items() if k not in CONFIG_FIELDS_IGNORED}


def model_hash(model_dir: str | os.PathLike, *, config: dict | None = None, files: list[Path] | None = None) -> str:
    """sha256 over every tensor (name, dtype, shape, bytes) in name order plus the behavioural config fields.

    Streams the safetensors files through mmap; the model is never built, and how the checkpoint is split into
    files does not matter. A caller that has already read the folder passes `config` (its config.json, parsed) and
    `files` (its `weight_files`), so neither is read again; the hash is the same.
    """
    tensors = _tensor_index(files if files is not None else weight_files(model_dir, config))
    config = config if config is not None else _read_config(model_dir)
    h = hashlib.sha256(b"refcache-model-v1")
    h.update(_canonical(config_fields(config)))
    if config.get("auto_map"):  # only then: a model without custom code keeps the hash it always had
        h.update(b"refcache-model-code-v1" + _canonical(code_digests(model_dir, config["auto_map"])))
    _hash_tensors(h, tensors)
    return h.hexdigest()


def code_digests(folder: str | os.PathLike, auto_map, source: str = "config.json") -> list[list[str]]:
    """[path, sha256] of the Python files a checkpoint folder's custom code can come from, where its `auto_map` (in
    `source`) makes transformers run code from it (with trust_remote_code): every *.py file directly in the folder
    and in the folder of each auto_map module. transformers 5.x (dynamic_module_utils) takes an entry
    'module.Class' (or 'sub/module.Class') from module.py there and the files it imports relatively
    (`from .x import y`), which it looks for in that same folder. Refused, as code that cannot be hashed: an entry
    naming another repository ('org/repo--module.Class'), a module outside the folder or one it does not hold.
    Modules imported absolutely (installed packages) are not the folder's."""
    root = Path(os.path.normpath(folder))
    if not isinstance(auto_map, dict):
        raise WeightsError(f"{root / source}: auto_map is not a JSON object")
    dirs = {root}
    for key, refs in auto_map.items():
        for ref in refs if isinstance(refs, list) else [refs]:
            if ref is None:
                continue
            if not isinstance(ref, str) or "." not in ref:
                raise WeightsError(f"{root / source}: auto_map {key} = {ref!r} is not a 'module.Class' name")
            if "--" in ref:
                raise WeightsError(
                    f"{root / source}: auto_map {key} = {ref!r} runs code from another repository, which refcache "
                    "cannot hash with the model; copy that code into the checkpoint folder and name it "
                    "'module.Class' there")
            module = Path(os.path.normpath(root / (ref.rsplit(".", 1)[0] + ".py")))
            if root != module.parent and root not in module.parents:
                raise WeightsError(f"{root / source}: auto_map {key} = {ref!r} names code outside the checkpoint "
                                   "folder, which refcache cannot hash with the model")
            if not module.is_file():
                raise WeightsError(f"{root / source}: auto_map {key} = {ref!r} names {module.relative_to(root)}, "
                                   "which is not in the checkpoint folder (its code cannot be hashed)")
            dirs.add(module.parent)
    files = sorted(p for d in dirs for p in d.iterdir() if p.name.endswith(".py") and p.is_file())
    return [[p.relative_to(root).as_posix(), file_sha256(p)] for p in files]


def _hash_tensors(h, tensors: dict) -> None:
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
            _drop_pages(maps[path], begin, end)
    finally:
        for m in maps.values():
            m.close()


def _drop_pages(mapped: mmap.mmap, begin: int, end: int) -> None:
    """Unmap the pages just hashed from this process (the page cache keeps them): without this, hashing a model
    adds its whole size to the resident memory, e.g. on top of a trained model and its optimizer state."""
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        start = begin - begin % mmap.PAGESIZE
        if end > start:
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)


def _tensor_index(files: list[Path]) -> dict:
    tensors = {}  # name -> (file, dtype, shape, begin, end)
    for path in files:
        with open(path, "rb") as f:
            header, data_start = _read_header(f, path)
        for name, info in header.items():
            if name in tensors:
                raise WeightsError(f"{path}: tensor {name!r} also appears in {tensors[name][0].name}")
            begin, end = info["data_offsets"]
            tensors[name] = (path, info["dtype"], info["shape"], data_start + begin, data_start + end)
    return tensors


# ---------------------------------------------------------------------------------------------------------------
# adapters (peft LoRA): a reference "base + adapter" is its own model with its own hash

# adapter_config.json fields that name files or the runtime, not what the adapter computes.
ADAPTER_FIELDS_IGNORED = frozenset({"base_model_name_or_path", "revision", "inference_mode", "peft_version",
                                    "auto_mapping", "runtime_config"})
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_config_fingerprint(adapter_dir: str | os.PathLike) -> dict:
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise WeightsError(f"{adapter_dir}: not a peft adapter folder (no {ADAPTER_CONFIG})")
    try:
        config = json.loads(record_bytes(path))
    except OSError as e:
        raise WeightsError(str(e)) from None
    except ValueError as e:
        raise WeightsError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise WeightsError(f"{path}: not a JSON object")
    return adapter_fields(config)


def adapter_fields(config: dict) -> dict:
    """The behavioural part of an adapter config, canonical (module lists are sets, saved in no fixed order)."""
    kept = {k: v for k, v in config.items() if k not in ADAPTER_FIELDS_IGNORED}
    for key in ("target_modules", "exclude_modules", "modules_to_save"):
        if isinstance(kept.get(key), list):
            kept[key] = sorted(kept[key])
    return kept


def adapter_hash(adapter_dir: str | os.PathLike) -> str:
    """sha256 over a peft adapter's behavioural config and its tensors (as model_hash does for a checkpoint)."""
    weights = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickles = [p.name for p in Path(adapter_dir).glob("adapter_model.bin")]
        raise WeightsError(f"{adapter_dir}: no {ADAPTER_WEIGHTS}" + (f" (only pickle weights {pickles[0]}; refcache "
                                                                      "loads safetensors only)" if pickles else ""))
    h = hashlib.sha256(b"refcache-adapter-v1")
    h.update(_canonical(adapter_config_fingerprint(adapter_dir)))
    _hash_tensors(h, _tensor_index([weights]))
    return h.hexdigest()


def merged_model_hash(base_hash: str, adapter_hash_: str) -> str:
    """The model hash of "base checkpoint + adapter merged into it": a hash of the two hashes, so it is known
    without merging, differs from the base's, and differs from the hash of a merged checkpoint saved to disk (whose
    weights are hashed directly: use one form for both precompute-ref and train-dpo)."""
    return hashlib.sha256(b"refcache-model-adapter-v1" + _canonical([base_hash, adapter_hash_])).hexdigest()


def reference_model_hash(model_dir: str | os.PathLike, adapter_dir: str | os.PathLike | None = None) -> str:
    """model_hash of a checkpoint, or with an adapter the hash of that checkpoint with the adapter merged in."""
    base = model_hash(model_dir)
    return base if adapter_dir is None else merged_model_hash(base, adapter_hash(adapter_dir))


# ---------------------------------------------------------------------------------------------------------------
# mask checksums of a shard or a whole cache (the per-row checksum lives in encoding.py beside the encoder)


def combined_mask_checksum(row_checksums, encoding_json: str) -> str:
    """Checksum of an ordered run of rows (a shard, or the whole cache in shard order) and the encoding config."""
    h = hashlib.sha256(b"refcache-masks-v1")
    h.update(encoding_json.encode("utf-8"))
    for c in row_checksums:
        h.update(bytes.fromhex(c))
    return h.hexdigest()


def ids_checksum(ids) -> str:
    """Checksum of a shard's row ids in order (the mask checksums cover the tokens, not the names of the rows)."""
    raw = [str(i).encode("utf-8", "surrogatepass") for i in ids]
    h = hashlib.sha256(b"refcache-ids-v1")
    h.update(struct.pack("<Q", len(raw)))
    h.update(struct.pack(f"<{len(raw)}Q", *map(len, raw)))
    h.update(b"".join(raw))
    return h.hexdigest()
