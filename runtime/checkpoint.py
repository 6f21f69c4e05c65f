"""Checkpoint folders: refuse what we will not load, then load the tokenizer and the model; device, dtype, RNG."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
from pathlib import Path

import numpy as np
import torch

from schemas.stamps import weight_files

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


def check_checkpoint(model_dir: str, trust_remote_code: bool) -> None:
    """Refuse checkpoints we will not load, before any expensive work."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise JobError(f"{model_dir}: not a Hugging Face checkpoint folder (no config.json)")
    weight_files(path)  # raises WeightsError for pickle-only or missing weights
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except ValueError as e:  # also UnicodeDecodeError
        raise JobError(f"{path / 'config.json'}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise JobError(f"{path / 'config.json'}: not a JSON object")
    if config.get("auto_map") and not trust_remote_code:
        raise JobError(
            f"{model_dir}: this model needs custom code from its folder (auto_map in config.json); refcache does not "
            "run it unless you pass --trust-remote-code"
        )


def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers and tokenizers raise many types here (OSError, ValueError, plain Exception)
        detail = " ".join(str(e).split())[:300]
        raise JobError(f"{model_dir}: its tokenizer cannot be loaded ({type(e).__name__}: {detail})") from None
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise JobError(f"{model_dir}: {type(tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer; refcache "
                       "needs a tokenizer.json")
    return tokenizer


def attention_choices(model_dir: str, trust_remote_code: bool = False) -> list[str]:
    """Attention implementations the model's class declares it supports (eager always)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except Exception:  # an unknown model type: nothing to say beyond eager
        return ["eager"]
    flags = (("sdpa", "_supports_sdpa"), ("flash_attention_2", "_supports_flash_attn"),
             ("flex_attention", "_supports_flex_attn"))
    return ["eager"] + [name for name, flag in flags if getattr(cls, flag, False)]


def pad_id(tokenizer) -> int:
    """The id padded positions carry (never scored): the tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, attn: str | None,
               trust_remote_code: bool = False, adapter: str | None = None):
    """The checkpoint, frozen, on `device`; with `adapter` (a peft LoRA folder) that adapter merged into it. attn None:
    the attention implementation transformers picks for the model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code, attn_implementation=attn
    )
    model = model.to(device)
    if adapter is not None:
        model = merge_adapter(model, adapter)
    return model.eval().requires_grad_(False)


def require_peft(what: str):
    """The peft module, or a one-line refusal naming the extra that installs it."""
    try:
        import peft
    except ImportError:
        raise JobError(f"{what} needs the peft package, which is not installed: pip install 'refcache[peft]'") from None
    return peft


def check_adapter(adapter_dir: str) -> None:
    from schemas.stamps import WeightsError, adapter_hash

    try:
        adapter_hash(adapter_dir)  # refuses a folder without adapter_config.json or safetensors weights
    except (WeightsError, OSError) as e:
        raise JobError(f"--adapter {adapter_dir}: {e}") from None


def merge_adapter(model, adapter_dir: str):
    """`model` with the peft adapter in `adapter_dir` merged into its weights (a plain transformers model again).

    precompute-ref and train-dpo both merge through here, on the device and dtype they run in, so a reference
    "base + adapter" is the same weights in both jobs."""
    peft = require_peft(f"the adapter {adapter_dir}")
    check_adapter(adapter_dir)
    try:
        wrapped = peft.PeftModel.from_pretrained(model, adapter_dir, is_trainable=False)
    except (ValueError, KeyError, RuntimeError) as e:  # adapter made for another architecture or shape
        detail = " ".join(str(e).split())[:300]
        raise JobError(f"--adapter {adapter_dir}: cannot be applied to this model ({detail})") from None
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


