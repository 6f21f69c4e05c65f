"""LoRA / QLoRA policies (peft): options, the policy wrapper, the reference a LoRA run must be checked against, the
adapter-disabled live reference and the outputs.

What the reference is:
- with a cache: the cache, whose model hash must be the base checkpoint's (the new adapter starts as identity, so
  at step 0 the policy is the base and the loss is ln 2);
- with --init-adapter A: A is merged into the base in memory and a fresh adapter trained on top, so the reference
  is "base + A" and the cache must have been made with `precompute-ref --model BASE --adapter A` (its model hash is
  schemas.stamps.merged_model_hash(base, A));
- live (--ref-model, no cache): the same model with the adapter disabled, no second model (TRL's convention).

Dropout: the base model's dropout is disabled (as in full DPO); --lora-dropout acts only on the adapter branch's
input, lora_B(lora_A(dropout(x))). lora_B starts at zero, so at step 0 that branch adds exactly zero with or without
dropout and the step-0 loss is ln 2; from step 1 on the policy's forward is stochastic in the adapter branch only
(as in TRL, which also keeps LoRA dropout). The reference (cache or disabled adapter) never sees dropout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from runtime.locations import read_locations
from runtime.options import field_help
from runtime.errors import JobError
from schemas.findings import StampMismatch
from schemas.stamps import ADAPTER_CONFIG, adapter_hash, model_hash

DEFAULT_TARGETS = "all-linear"  # peft: every linear layer of the blocks (attention and MLP projections), not the head
MERGED_DIR = "merged"


def _f(default, help, **extra):
    return field(default=default, metadata=field_help(help, "LoRA", **extra))


@dataclass
class LoraOptions:
    """train-dpo's LoRA options (generated as --use-peft, --lora-r, ...); names and defaults as TRL's ModelConfig."""

    use_peft: bool = _f(False, "Train a LoRA adapter (peft) instead of the full model; the reference is the base "
                               "model.")
    lora_r: int = _f(16, "LoRA rank.", domain="count")
    lora_alpha: int = _f(32, "LoRA alpha (the adapter's output is scaled by alpha / r).", domain="count")
    lora_dropout: float = _f(0.05, "Dropout on the adapter branch's input only (base-model dropout stays off; the "
                                   "step-0 loss is still ln 2 because the adapter starts at zero).",
                       domain="probability")
    lora_target_modules: str | None = _f(None, "Comma-separated module names to adapt (default: all-linear, i.e. "
                                               "every attention and MLP projection, not the output head).")
    load_in_4bit: bool = _f(False, "QLoRA: load the base in 4 bits (bitsandbytes, CUDA only).")
    load_in_8bit: bool = _f(False, "Load the base in 8 bits (bitsandbytes, CUDA only).")
    init_adapter: str | None = _f(None, "Start from this adapter (e.g. an SFT LoRA): it is merged into the base and a "
                                        "new adapter is trained on top; the reference is base + this adapter (cache: "
                                        "precompute-ref --adapter).", location="input")
    merge_adapter: bool = _f(False, f"Also write the base with the trained adapter merged in to "
                                    f"OUTPUT_DIR/{MERGED_DIR}.")

    def __post_init__(self):
        read_locations(self)


def check_options(opts: LoraOptions) -> None:
    """Refuse inconsistent LoRA options and platforms that cannot run them, before any expensive work (the
    --init-adapter folder itself is checked where the policy checkpoint is opened: `init_adapter`)."""
    if not opts.use_peft:  # every LoRA option set away from its default: it would be ignored (and recorded)
        given = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(opts)
                 if f.name != "use_peft" and getattr(opts, f.name) != f.default]
        if given:
            raise JobError(f"{', '.join(given)} only apply to a LoRA policy; add --use-peft")
        return
    from runtime.checkpoint import require_peft

    require_peft("--use-peft")
    if opts.lora_r < 1:
        raise JobError(f"--lora-r must be at least 1, got {opts.lora_r}")
    if not 0 <= opts.lora_dropout < 1:
        raise JobError(f"--lora-dropout must be in [0, 1), got {opts.lora_dropout}")
    if opts.load_in_4bit or opts.load_in_8bit:
        _check_quantization(opts)


def notes(opts: LoraOptions, cached: bool) -> list[str]:
    """What the user should know about this LoRA setup before training starts."""
    if cached and opts.use_peft and (opts.load_in_4bit or opts.load_in_8bit):
        return ["note: the cache holds the unquantized reference, the policy starts from the quantized base: the "
                "step-0 loss differs from ln 2 by the quantization error"]
    return []


def _check_quantization(opts: LoraOptions) -> None:
    import importlib.util

    import torch

    flag = "--load-in-4bit" if opts.load_in_4bit else "--load-in-8bit"
    if opts.load_in_4bit and opts.load_in_8bit:
        raise JobError("--load-in-4bit and --load-in-8bit exclude each other; choose one")
    if not torch.cuda.is_available():
        raise JobError(f"{flag} needs a CUDA GPU: bitsandbytes quantized layers have no CPU training path, and this "
                       "machine has no CUDA device; drop the option (plain LoRA in full precision)")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise JobError(f"{flag} needs the bitsandbytes package, which is not installed: pip install 'refcache[qlora]'")
    if opts.init_adapter is not None:
        raise JobError(f"--init-adapter with {flag}: the initial adapter would be merged into quantized weights, "
                       "which is not the reference precompute-ref --adapter computes; merge it into the base in full "
                       "precision, save that checkpoint and use it as --model (and as precompute-ref's --model)")


def load_kwargs(opts: LoraOptions, dtype) -> dict:
    """Extra from_pretrained arguments for a quantized base (QLoRA)."""
    if not (opts.use_peft and (opts.load_in_4bit or opts.load_in_8bit)):
        return {}
    from transformers import BitsAndBytesConfig

    if opts.load_in_8bit:
        return {"quantization_config": BitsAndBytesConfig(load_in_8bit=True)}
    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                      bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True)}


def init_adapter(opts: LoraOptions) -> str | None:
    """The adapter the policy checkpoint is opened with (runtime.checkpoint.Checkpoint: checked and hashed there,
    merged on load), so its model hash is what a LoRA run's cache must carry: the base's, or with --init-adapter the
    merged base + adapter's."""
    return opts.init_adapter if opts.use_peft else None


@contextlib.contextmanager
def explained_reference(opts: LoraOptions, model: str, base_hash: str):
    """Re-word a model-hash mismatch so a LoRA user knows which reference the cache must hold and how to make it."""
    try:
        yield
    except StampMismatch as e:
        if not opts.use_peft or e.kind != "model_hash":
            raise
        if opts.init_adapter is None:
            e.message = (f"model_hash mismatch: with --use-peft the reference is the base checkpoint --model {model} "
                         f"(the adapter starts as identity), but the cache {e.message.split('the cache ')[-1]}")
            e.remedy = (f"make the cache from the base (precompute-ref --model {model}); if it was made with "
                        "--adapter A, pass --init-adapter A")
        else:
            held = " (it holds the base without the adapter)" if e.found == base_hash else ""
            e.message = (f"model_hash mismatch: with --init-adapter {opts.init_adapter} the reference is --model "
                         f"{model} with that adapter merged in, and the cache was not computed from it{held}")
            e.remedy = f"make the cache with precompute-ref --model {model} --adapter {opts.init_adapter}"
        raise


def check_live_reference(policy, reference) -> None:
    """Live LoRA: the reference is --model with the adapter disabled, so --ref-model (`reference`, the policy's own
    Checkpoint when it names the same folder) must be that checkpoint."""
    if reference is not policy and reference.base_hash != policy.base_hash:
        raise JobError(f"--ref-model {reference.path} differs from --model: with --use-peft the live reference is "
                       "--model with the adapter disabled (no second model); pass --ref-model equal to --model, or use "
                       "a --ref-cache made from the other reference")


def base_name(base: dict) -> str:
    """How the adapter names its base model (adapter_config.json's `base_model_name_or_path`, what
    `AutoPeftModelForCausalLM` loads): the hub id --model was given as, else the folder's absolute path, so the adapter
    loads from any working directory. `base`: runtime.hub.origin of --model."""
    return base.get("hub_id") or str(Path(base["path"]).resolve())


def target_modules(given: str | list | None) -> str | list[str]:
    """--lora-target-modules as peft takes it: module names as a list, and `all-linear` (alone) as peft's own special
    value, a string (in a list peft would look for a module named all-linear)."""
    if isinstance(given, (list, tuple)):  # a --config file's list, as TRL's configs write it
        given = ",".join(map(str, given))
    targets = [t.strip() for t in given.split(",") if t.strip()] if given else []
    if not targets or targets == [DEFAULT_TARGETS]:
        return DEFAULT_TARGETS
    if DEFAULT_TARGETS in targets:
        raise JobError(f"--lora-target-modules {given}: {DEFAULT_TARGETS} already names every linear layer; give it "
                       "alone, or only module names")
    return targets


def wrap_policy(model, opts: LoraOptions, gradient_checkpointing: bool, seed: int, base: dict):
    """The base (with --init-adapter merged in when it was loaded) wrapped with a fresh, trainable LoRA adapter, its
    random lora_A drawn from `seed` (the Trainer seeds only after the model is built; without this the run would not
    be reproducible). `base`: runtime.hub.origin of --model, recorded in every saved adapter_config.json (its name,
    and for a hub id the snapshot's commit as `revision`)."""
    import torch

    from runtime.checkpoint import quiet_peft, require_peft

    peft = require_peft("--use-peft")
    # peft records model.name_or_path (the path as given to from_pretrained, maybe relative) as the base
    model.name_or_path = model.config._name_or_path = base_name(base)
    if opts.load_in_4bit or opts.load_in_8bit:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    elif gradient_checkpointing:
        model.enable_input_require_grads()  # the frozen embeddings' output must carry grad through checkpoints
    config = peft.LoraConfig(
        r=opts.lora_r, lora_alpha=opts.lora_alpha, lora_dropout=opts.lora_dropout, bias="none", task_type="CAUSAL_LM",
        target_modules=target_modules(opts.lora_target_modules),
    )
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())), quiet_peft():  # QLoRA: on the GPU
            torch.manual_seed(seed)
            return peft.get_peft_model(model, config, revision=base.get("revision"))
    except ValueError as e:  # e.g. target modules not found in the model
        raise JobError(f"--lora-target-modules: {' '.join(str(e).split())[:300]}") from None


class AdapterDisabled:
    """Live reference of a LoRA policy: the policy's own forward with the adapter switched off."""

    def __init__(self, policy):
        self.module = policy  # runtime.logprobs.unwrap finds the model through `.module`

    def __call__(self, **inputs):
        with self.module.disable_adapter():
            return self.module(**inputs)

    # what the batch-layout probe reads of a model (dpo/layout.py): the policy's own
    config = property(lambda self: self.module.config)
    dtype = property(lambda self: self.module.dtype)

    def parameters(self):
        return self.module.parameters()


def save_outputs(policy, out: Path, opts: LoraOptions, tokenizer) -> None:
    """The adapter is in `out` already (Trainer.save_model); with --merge-adapter also the merged model."""
    if opts.merge_adapter:
        merged = policy.merge_and_unload()
        merged.save_pretrained(out / MERGED_DIR, safe_serialization=True)
        tokenizer.save_pretrained(out / MERGED_DIR)


def manifest_section(opts: LoraOptions, out: Path, policy, reference: str) -> dict:
    """The run manifest's `peft` section: what audit-ref --run checks. `policy`: the Checkpoint trained from."""
    init = None
    if opts.init_adapter is not None:
        init = {"path": opts.init_adapter, "adapter_hash": policy.adapter_hash}
    section = {
        "base_model_hash": policy.base_hash,
        "init_adapter": init,
        "reference_model_hash": reference,
        "adapter_config": json.loads((out / ADAPTER_CONFIG).read_text(encoding="utf-8")),
        "final_adapter_hash": adapter_hash(out),
        "merged_model_hash": model_hash(out / MERGED_DIR) if opts.merge_adapter else None,
        "options": dataclasses.asdict(opts),
    }
    return section
