"""The reference TRL would have used, hashed for dpo.trl's DPOTrainer (dpo/trl.py): `ref_model` if given, else the
policy's starting weights (with peft_config the base), identified by its checkpoint folder's model hash, never run; a
model passed in memory must still hold that folder's weights."""

from __future__ import annotations

from runtime.errors import JobError


def _folder_of(model, what: str) -> str:
    """The checkpoint folder a model (a path, a hub id, or a model loaded from one) comes from."""
    from runtime.hub import resolve_model

    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name:
        raise JobError(f"{what} was not loaded from a checkpoint folder (its config names none), so its weights "
                       "cannot be hashed against the cache; save it (save_pretrained) and load it from there")
    return resolve_model(str(name))


def _same_weights(model, folder: str, what: str) -> None:
    """A model passed in memory still holds its folder's weights (in the dtype it was loaded in): the cache's model
    hash is the folder's, so a model changed after loading would be another reference. Compared, never run."""
    import torch
    from safetensors import safe_open

    from schemas.stamps import weight_files

    state = {k: v for k, v in model.state_dict().items()}
    unknown = []
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                held = state.get(name)
                if held is None:
                    unknown.append(name)
                    continue
                stored = f.get_tensor(name).to(held.dtype)
                if stored.shape != held.shape or not torch.equal(stored, held.detach().to("cpu")):
                    raise JobError(f"model_hash mismatch: {what} differs from its checkpoint folder {folder} in "
                                   f"tensor {name!r} (changed after loading), so it is not the model the folder's "
                                   "hash names; save it (save_pretrained) and make the cache from that folder")
    if unknown:
        raise JobError(f"{what}: the tensors of {folder} are stored under other names than the model's (first: "
                       f"{unknown[0]!r}), so refcache cannot compare them with the model in memory; pass the model "
                       "as its folder path")


def reference_hash(model, ref_model, peft_config) -> tuple[str, str]:
    """(folder, model hash) of the reference TRL would use: `ref_model` if given, else the policy's starting weights
    (with peft_config: the base, the adapter disabled)."""
    from schemas.stamps import model_hash

    if ref_model is not None:
        folder = _folder_of(ref_model, "ref_model")
        _same_weights(ref_model, folder, "ref_model")
        return folder, model_hash(folder)
    if _is_peft(model):
        raise JobError("model is a PeftModel with an adapter loaded: TRL's reference is then a copy of that adapter, "
                       "which refcache cannot hash; merge it (merge_and_unload), save the merged checkpoint and pass "
                       "its folder as model with peft_config (precompute-ref --model MERGED makes the cache)")
    folder = _folder_of(model, "model")
    if not isinstance(model, str):
        _same_weights(model, folder, "model")
    return folder, model_hash(folder)


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)
