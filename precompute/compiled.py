"""precompute-ref --torch-compile: the scoring forward compiled by torch.compile (dynamic shapes), a fast path like
any batching mode. It is used only once it reproduces `runtime.logprobs.reference_logps`, run on the eager model
(never on the compiled one: the check would be circular), on the mode's probe of the job's own pairs, the longest
included; otherwise the job scores with the eager model and says why.

What compiles is the decoder's own forward (the base model: embeddings, every layer, the final norm), called through
the eager module so that its forward hooks stay outside the graph: the scoring head runs in such a hook (chunked,
eager), and a hook inside a compiled forward is a graph break, which splits each graph in two and makes torch.compile
trace the forward twice. Compiling each decoder layer instead (one graph for all layers) does not hold for
kv_cache: each layer reads its own slot of the key/value cache, so each layer compiles apart."""

from __future__ import annotations

from functools import partial

import torch

from runtime.logprobs import unwrap
from runtime.probe import disagreement, reference_values
from schemas.encoding import EncodedPair

from .modes.choose import mode_values


class CompiledDecoder(torch.nn.Module):
    """`model` whose base model's forward runs compiled during this module's own forward only. Like torch.compile's
    wrapper it keeps the eager model as `_orig_mod` (runtime.logprobs.uncompiled and unwrap find it there) and answers
    for its attributes; outside this forward the model is untouched, so the reference forward stays eager."""

    def __init__(self, model, decoder: torch.nn.Module):
        super().__init__()
        self._orig_mod = model
        # plain attributes, not submodules: the decoder is the model's own
        self.__dict__["_decoder"] = decoder
        self.__dict__["_fast"] = torch.compile(decoder.forward, dynamic=True)

    def __getattr__(self, name: str):
        if name == "_orig_mod":
            return self._modules["_orig_mod"]
        return getattr(self._orig_mod, name)

    def forward(self, *args, **kwargs):
        decoder = self._decoder
        decoder.forward = self._fast  # an instance attribute: nn.Module's call runs it between its hooks
        try:
            return self._orig_mod(*args, **kwargs)
        finally:
            del decoder.forward


def compile_scoring(model):
    """The model to score with: its base model's forward compiled (CompiledDecoder); a model without a separate base
    model, or one whose base model's forward is already replaced (e.g. accelerate's device-map hooks), compiles whole
    (torch.compile's own wrapper). Nothing compiles until the first forward."""
    inner = unwrap(model)
    decoder = getattr(inner, "base_model", None)
    if model is not inner or decoder is None or decoder is inner or "forward" in vars(decoder):
        return torch.compile(model, dynamic=True)
    return CompiledDecoder(model, decoder)


def compiled_scorer(model, mode: str, probe: list[EncodedPair], pad_id: int, top_k: int, log) -> tuple[object, bool]:
    """(the model to score with, whether it is the compiled one). The probe's first calls also compile the graphs, so
    the job's batches reuse them (shapes are symbolic; a new graph only where a size of 0 or 1 specialises)."""
    try:
        compiled = compile_scoring(model)
    except Exception as e:  # e.g. a platform torch.compile does not support
        reason = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    else:
        truth = reference_values(model, probe, top_k)  # the eager forward
        reason = disagreement(model, partial(mode_values, compiled, mode, pad_id=pad_id, top_k=top_k), probe,
                              truth=truth, where=" when compiled")
    if reason is not None:
        log(f"torch.compile: not used, scoring with the uncompiled model ({reason})")
        return model, False
    what = "its decoder" if isinstance(compiled, CompiledDecoder) else "the whole model"
    log(f"torch.compile: the {mode} forward compiled ({what}, dynamic shapes); matches the reference forward on the "
        "probe")
    return compiled, True
