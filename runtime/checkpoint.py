"""Checkpoint folders (`Checkpoint`: checked once, then the tokenizer, hash and model from it); device, dtype, RNG."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import os
import platform
import random
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from schemas.stamps import WeightsError, adapter_hash, merged_model_hash, model_hash, weight_files
from storage.reads import NotARecord, record_bytes

from .errors import JobError


def resolve_device(device: str) -> torch.device:
    if device != "auto":
        try:
            resolved = torch.device(device)
        except RuntimeError as e:
            raise JobError(f"--device {device}: {e}; use auto, cpu, cuda or cuda:N") from None
        if resolved.type == "cuda" and not torch.cuda.is_available():
            raise JobError(f"--device {device}: CUDA is not available on this machine; use --device cpu or auto")
        return resolved
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A checkpoint folder, checked once (`open`) and then read at most once per thing: its config.json and weight
    files at `open`, the tokenizer and the model hash when first asked for (then kept), the model at each
    `load_model`. With `adapter` (a peft LoRA folder) the model is base + adapter: merged on load, hashed as such."""

    path: str
    config: dict  # config.json, parsed
    files: tuple[Path, ...]  # the safetensors files transformers loads (schemas.stamps.weight_files)
    trust_remote_code: bool = False
    adapter: str | None = None
    adapter_hash: str | None = None  # set by `open`, which checks the adapter

    @classmethod
    def open(cls, model_dir: str, trust_remote_code: bool = False, adapter: str | None = None) -> "Checkpoint":
        """Refuse a folder we will not load (no config.json, pickle-only or missing weights, custom code not
        allowed, an unusable adapter), before any expensive work."""
        path = Path(model_dir)
        if not path.exists():
            from storage.nearby import missing

            raise JobError(missing(model_dir))
        from .locations import checkpoint_problem

        if checkpoint_problem(path):
            raise JobError(f"{model_dir}: {checkpoint_problem(path)}")
        check_readable(model_dir)
        try:
            config, problem = json.loads(record_bytes(path / "config.json")), None
        except NotARecord as e:
            config, problem = None, f"not a file to read ({e})"
        except ValueError as e:  # also UnicodeDecodeError
            config, problem = None, f"not valid JSON ({e})"
        files = weight_files(path, config if isinstance(config, dict) else {})  # WeightsError: pickle-only, missing
        if problem is None and not isinstance(config, dict):
            problem = "not a JSON object"
        if problem:
            raise JobError(f"{path / 'config.json'}: {problem}")
        if config.get("auto_map") and not trust_remote_code:
            raise JobError(
                f"{model_dir}: this model needs custom code from its folder (auto_map in config.json); refcache does "
                "not run it unless you pass --trust-remote-code"
            )
        kernel = _hub_kernel(config)
        if kernel and not trust_remote_code:  # transformers would fetch and run it even at --attn-implementation auto
            raise JobError(
                f"{model_dir}: its config.json asks for the attention kernel {kernel!r}, code downloaded from the hub "
                "and run; refcache does not run it unless you pass --trust-remote-code (or remove that key)")
        adapter = None if adapter is None else str(adapter)  # as peft and the manifests take it
        return cls(str(model_dir), config, tuple(files), trust_remote_code, adapter,
                   None if adapter is None else check_adapter(adapter))

    @functools.cached_property
    def tokenizer(self):
        return load_tokenizer(self.path, self.trust_remote_code)

    @property
    def pad_id(self) -> int:
        """The id padded positions carry (never scored): the tokenizer's pad token, else its EOS."""
        tokenizer = self.tokenizer
        return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def start_hashing(self) -> None:
        """Compute `base_hash` in a background thread from now on, so that it overlaps what the job does before it
        first needs the hash (loading the tokenizer, reading and encoding the data, hashing cache shards): sha256
        releases the GIL. The same files and config are hashed as `base_hash` alone would hash; only the moment
        changes, and `base_hash` waits for the result (or raises the thread's error)."""
        if "base_hash" in self.__dict__ or "_hashing" in self.__dict__:
            return
        pending = concurrent.futures.Future()

        def work():
            try:
                pending.set_result(model_hash(self.path, config=self.config, files=list(self.files)))
            except BaseException as e:  # handed to whoever asks for base_hash
                pending.set_exception(e)

        self.__dict__["_hashing"] = pending  # frozen dataclass: its cached values live in __dict__
        threading.Thread(target=work, name=f"model-hash {self.path}", daemon=True).start()

    @functools.cached_property
    def base_hash(self) -> str:
        """schemas.stamps.model_hash of the folder (without the adapter), from what `open` read."""
        pending = self.__dict__.pop("_hashing", None)
        if pending is not None:
            return pending.result()
        return model_hash(self.path, config=self.config, files=list(self.files))

    @functools.cached_property
    def model_hash(self) -> str:
        """The model's stamp: the folder's hash, or with an adapter the hash of base + adapter merged."""
        return self.base_hash if self.adapter is None else merged_model_hash(self.base_hash, self.adapter_hash)

    def attention_choices(self) -> list[str]:
        """Attention implementations the model's class declares it supports (eager always)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
            cls = AutoModelForCausalLM._model_mapping[type(config)]
        except Exception:  # an unknown model type: nothing to say beyond eager
            return ["eager"]
        flags = (("sdpa", "_supports_sdpa"), ("flash_attention_2", "_supports_flash_attn"),
                 ("flex_attention", "_supports_flex_attn"))
        return ["eager"] + [name for name, flag in flags if getattr(cls, flag, False)]

    def load_model(self, dtype: torch.dtype, device: torch.device | None = None, attn: str | None = None, *,
                   trainable: bool = False, **extra):
        """The model (with the adapter merged in), on `device` (None: where transformers puts it), frozen unless
        `trainable`. attn None: the attention implementation transformers picks for the model; `extra`: further
        from_pretrained arguments (a quantization config)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            self.path, dtype=dtype, use_safetensors=True, trust_remote_code=self.trust_remote_code,
            attn_implementation=attn, **extra
        )
        if device is not None:
            model = model.to(device)
        if self.adapter is not None:
            model = _merge_adapter(model, self.adapter)
        return model if trainable else model.eval().requires_grad_(False)


def _hub_kernel(config) -> str | None:
    """A hub kernel (org/name) a model's config.json, or a sub-config in it, names as its attention implementation."""
    from .placed import is_hub_kernel

    if not isinstance(config, dict):
        return None
    for key, value in config.items():
        if key in ("_attn_implementation", "attn_implementation") and is_hub_kernel(value):
            return value
        found = _hub_kernel(value) if isinstance(value, dict) else None
        if found:
            return found
    return None


# the files of a checkpoint folder that transformers reads besides config.json (which `open` reads itself) for the
# model and its tokenizer, where present; one it cannot read as a file it may skip without a word, and then a chat
# template fails on the data's first row
READ_FILES = ("generation_config.json", "tokenizer_config.json", "tokenizer.json",
              "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json",
              "merges.txt", "tokenizer.model")


def check_readable(model_dir) -> None:
    """Refuse (JobError) a local checkpoint folder holding one of READ_FILES that cannot be read as a file (a FIFO, a
    folder, a file this user may not open), naming it as the folder's file, before transformers skips it and the
    fault shows up as the data's (storage/reads.py `unreadable`: never blocks on a FIFO)."""
    from storage.reads import unreadable

    folder = Path(model_dir)
    if not folder.is_dir():
        return  # a hub id: the hub's reader judges it
    for name in READ_FILES:
        path = folder / name
        if os.path.lexists(path) and (why := unreadable(path)):
            raise JobError(f"{model_dir}: the model folder's {name} cannot be read: {why}; transformers "
                           f"reads it for the {'model' if name == 'generation_config.json' else 'tokenizer'}: put the "
                           "checkpoint's own file there (or remove it, if the checkpoint has none)")


def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    check_readable(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers and tokenizers raise many types here (OSError, ValueError, plain Exception)
        detail = " ".join(str(e).split())[:300]
        raise JobError(f"{model_dir}: its tokenizer cannot be loaded ({type(e).__name__}: {detail})") from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise JobError(f"{model_dir}: {type(tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer; refcache "
                       "needs a tokenizer.json")
    return tokenizer


def require_peft(what: str):
    """The peft module, or a one-line refusal naming the extra that installs it."""
    try:
        import peft
    except ImportError:
        raise JobError(f"{what} needs the peft package, which is not installed: pip install 'refcache[peft]'") from None
    return peft


def check_adapter(adapter_dir: str) -> str:
    """The adapter's hash; a folder without adapter_config.json or safetensors weights is refused."""
    try:
        return adapter_hash(adapter_dir)
    except (WeightsError, OSError) as e:
        raise JobError(f"the adapter {adapter_dir}: {e}") from None


@contextlib.contextmanager
def quiet_peft():
    """Around peft wrapping a model: peft asks transformers' deprecated model.is_gradient_checkpointing, a
    FutureWarning from one library to another that no user of ours can act on; only that notice is silenced."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def _merge_adapter(model, adapter_dir: str):
    """`model` with the peft adapter in `adapter_dir` (checked by `Checkpoint.open`) merged into its weights (a plain
    transformers model again). precompute-ref and train-dpo both merge through here (`Checkpoint.load_model`), on the
    device and dtype they run in, so a reference "base + adapter" is the same weights in both jobs."""
    peft = require_peft(f"the adapter {adapter_dir}")
    try:
        with quiet_peft():
            wrapped = peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=False)
    except (ValueError, KeyError, RuntimeError) as e:  # adapter made for another architecture or shape
        detail = " ".join(str(e).split())[:300]
        raise JobError(f"the adapter {adapter_dir}: cannot be applied to this model ({detail})") from None
    return wrapped.merge_and_unload()


def software_versions() -> dict:
    import datasets
    import pyarrow
    import transformers
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("refcache")
    except PackageNotFoundError:
        ours = "unknown"
    return {"refcache": ours, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "datasets": datasets.__version__, "pyarrow": pyarrow.__version__}


@contextlib.contextmanager
def preserved_rng():
    """Leave the caller's global RNG state (python, numpy, torch CPU and CUDA) as it was."""
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


