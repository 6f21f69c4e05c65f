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

import contextlib
import os
import time
from pathlib import Path

import torch

from runtime.logprobs import unwrap
from runtime.paths import refcache_home
from runtime.probe import disagreement, reference_values
from runtime.terminal import counted
from schemas.encoding import EncodedPair

from .modes.scoring import Current, batch_costs, score_pairs


class CompiledDecoder(torch.nn.Module):
    """`model` whose base model's forward runs compiled during this module's own forward only. Like torch.compile's
    wrapper it keeps the eager model as `_orig_mod` (runtime.logprobs.uncompiled and unwrap find it there) and answers
    for its attributes; outside this forward the model is untouched, so the reference forward stays eager.

    torch.compile builds a new graph for inputs its graphs' guards do not admit (a dimension of size 1 where the
    graph was built for more: a batch of one row, a one-token continuation, a cache of one row). Once `proven` (the
    probe ran and checked every graph there is), such an input runs eager instead (torch.compiler.set_stance
    "eager_on_recompile"): a graph built after the check would never be checked, and costs as much to build."""

    def __init__(self, model, decoder: torch.nn.Module):
        super().__init__()
        self._orig_mod = model
        # plain attributes, not submodules: the decoder is the model's own
        self.__dict__.update(_decoder=decoder, _fast=torch.compile(decoder.forward, dynamic=True), proven=False)

    def __getattr__(self, name: str):
        if name == "_orig_mod":
            return self._modules["_orig_mod"]
        return getattr(self._orig_mod, name)

    def forward(self, *args, **kwargs):
        decoder = self._decoder
        decoder.forward = self._fast  # an instance attribute: nn.Module's call runs it between its hooks
        try:
            with torch.compiler.set_stance("eager_on_recompile") if self.proven else contextlib.nullcontext():
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


# --torch-compile auto (neither flag): compile where it pays. Compiling costs a fixed time C, then scores at the
# compiled rate, SPEEDUP x the eager one; on a job whose eager scoring would take E it pays when E (1 - 1/SPEEDUP) > C.
# Measured (bench/RESULTS.md part 16, 35M long-prompt case, 2-core CPU): the compiled scoring 1.03x the eager rate;
# precompute-ref end to end 55.5 s with a cold inductor cache against 11.6 s eager (C about 44 s), 28.2 s warm (C
# about 17 s): so on CPU compiling pays past E = C / (1 - 1/1.03), about 10 minutes of eager scoring warm, 25 cold.
SPEEDUP = 1.03
COMPILE_SECONDS = {"cold": 44.0, "warm": 17.0}
# On CUDA (bench/results/gpu-compile-h200.json: H200, 35M Llama, bf16, sdpa, 64 long-prompt pairs, full_forward):
# compiled scoring 1.39x the eager rate, 29.7 s of cold compiling (break-even about 106 s of eager scoring). A warm
# compile was not measured there: the cold figure stands for both (a warm one costs less, so this errs to eager).
CUDA_SPEEDUP = 1.39
CUDA_COMPILE_SECONDS = {"cold": 29.7, "warm": 29.7}


def figures(device_type: str) -> tuple[float, dict]:
    """(compiled speed-up, compile seconds cold/warm) measured on this kind of device; other accelerators use the
    CPU's figures (the more reluctant ones) until one is measured."""
    return (CUDA_SPEEDUP, CUDA_COMPILE_SECONDS) if device_type == "cuda" else (SPEEDUP, COMPILE_SECONDS)


def inductor_cache() -> Path:
    """Where torch.compile's inductor caches go (refcache's home, unless TORCHINDUCTOR_CACHE_DIR says otherwise), so
    a second job of the same model and shapes compiles warm."""
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or refcache_home() / "inductor")


# The load (issue 39): the measured eager rate is wall-clock, so on a machine shared with other jobs it reads slow
# and the job's eager estimate grows with the load, while the compile seconds above were measured on an idle machine:
# on 2 cores at load 6-14 auto compiled a 240-pair job because the probe read 4x slow, and the cold compile then took
# about 260 s, not 44. So both sides are taken at the machine's present load: the compile seconds are scaled by
# cpu_slowdown(), how many times longer than unloaded one thread's CPU work takes now (compiling is one thread's
# work: tracing, code generation, the C++ or Triton compiler). A job slowed k times with its compile slowed k times
# gets the decision of the idle machine. Not CPU seconds instead of wall seconds: measured here, torch's OpenMP
# threads spin while oversubscribed, so a forward's CPU seconds grew 1.5-4.5x under load too, and on CUDA they
# measure the host, not the device.
SLOWDOWN_SLICES, SLICE_STEPS = 200, 40_000  # about 0.65 ms a slice on this project's 2-core CPU, 0.13 s in all idle


def cpu_slowdown(slices: int = SLOWDOWN_SLICES, steps: int = SLICE_STEPS) -> float:
    """How many times longer one thread's CPU work takes now than unloaded (1.0 on an idle machine): `slices` equal
    pieces of pure-Python work, their total wall time over `slices` times the fastest piece's. A piece that ran
    without being preempted takes the unloaded time; on a loaded machine the others wait their turn for a core, so
    the total grows with the share of a core this process gets, with no figure measured elsewhere to compare to."""
    times = []
    for _ in range(slices):
        start, x = time.perf_counter(), 0
        for i in range(steps):  # deliberately the interpreter's own work: no library call that may use threads
            x += i
        times.append(time.perf_counter() - start)
    return max(1.0, sum(times) / (len(times) * max(min(times), 1e-9)))


def compile_choice(requested: bool | None, eager_seconds: float | None, *, split: bool = False,
                   warm: bool = False, device_type: str = "cpu", slowdown: float = 1.0) -> tuple[bool, str]:
    """(compile or not, why, in words that do not depend on the machine's speed or load: the manifest notes them):
    --torch-compile (True) and --no-torch-compile (False) as given; auto (None) compiles when the job's estimated
    eager scoring time, `eager_seconds` (wall-clock, at the machine's present load), saves more at SPEEDUP than
    compiling costs at that load: the measured compile seconds (cold, or `warm` with an inductor cache already there)
    times `slowdown` (cpu_slowdown()); a split model (--device-map, --tp-size) scores eager."""
    if requested is not None:
        return requested, "--torch-compile" if requested else "--no-torch-compile"
    if split:
        return False, "auto: a split model scores uncompiled"
    if eager_seconds is None:
        return False, "auto: eager, no measured eager rate"
    speedup, seconds = figures(device_type)
    if eager_seconds * (1 - 1 / speedup) > seconds["warm" if warm else "cold"] * slowdown:
        return True, "auto: compiled, the job's estimated eager scoring is past the break-even"
    return False, "auto: eager, the job's estimated eager scoring is under the break-even"


def estimate_text(eager_seconds: float | None, warm: bool, device_type: str = "cpu", slowdown: float = 1.0) -> str:
    """The figures behind an auto choice, for the log."""
    if eager_seconds is None:
        return "no estimate"
    speedup, seconds = figures(device_type)
    cache = "warm" if warm else "cold"
    cost = seconds[cache] * slowdown
    load = (f"{seconds[cache]:.0f} s measured unloaded x {slowdown:.1f}, this machine's present CPU slowdown"
            if slowdown > 1 else "unloaded: no CPU slowdown measured now")
    return (f"eager scoring estimated at {eager_seconds:.0f} s; compiling would save {eager_seconds * (1 - 1 / speedup):.0f}"
            f" s for about {cost:.0f} s of compiling with a {cache} inductor cache ({load}), at {speedup:g}x "
            f"the eager rate compiled ({device_type}'s measured figures)")


def warm_cache() -> bool:
    """Whether inductor's FX graph cache under inductor_cache() holds anything yet."""
    return any((inductor_cache() / "fxgraph").glob("*")) if (inductor_cache() / "fxgraph").is_dir() else False


def compiled_scorer(model, mode: str, probe: list[EncodedPair], pad_id: int, top_k: int, log,
                    token_budget: int, truth: list | None = None) -> tuple[object, bool]:
    """(the model to score with, whether it is the compiled one). The probe's pairs are scored compiled in the
    batches the job's own `token_budget` makes of them (for kv_cache and full_forward one padded batch, the longest
    pair among the short ones), which also compiles the graphs the job's batches reuse (shapes are symbolic); a batch
    no graph of the probe admits (e.g. one row) then runs eager (CompiledDecoder). `truth`: reference_values of
    `probe` on this (eager) model when the batching-mode probe already computed it (choose_mode's `probed`), so the
    job's longest pairs go through the whole forward once, not once more for this check."""
    try:
        compiled = compile_scoring(model)
    except Exception as e:  # e.g. a platform torch.compile does not support
        reason = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    else:
        def fast(pairs):
            chosen, rejected, _ = score_pairs(compiled, pairs, pad_id, token_budget, mode, top_k=top_k)
            return [x for pair in zip(chosen, rejected) for x in pair]

        truth = reference_values(model, probe, top_k) if truth is None else truth  # the eager forward's
        reason = disagreement(model, fast, probe, truth=truth, where=" when compiled")
    if reason is not None:
        log(f"torch.compile: not used, scoring with the uncompiled model ({reason})")
        return model, False
    if isinstance(compiled, CompiledDecoder):
        compiled.proven = True
    what = "its decoder" if isinstance(compiled, CompiledDecoder) else "the whole model"
    log(f"torch.compile: the {mode} forward compiled ({what}, dynamic shapes); matches the reference forward on the "
        "probe")
    return compiled, True


# --torch-compile auto decides on the job's own first batches, scored eager: the first batch is left out of the rate
# (one-time costs: the allocator, kernel selection), then it waits for at least CALIBRATION_BATCHES more and
# CALIBRATION_SECONDS of their scoring. A job done before that never decides and never compiles, at no extra cost;
# a decision made that late loses at most CALIBRATION_SECONDS (1 - 1/speed-up) against one made at the start. The
# probe's one call (its wall time, which earlier versions weighed) is not used: on three back-to-back calls it read 0.92, 1.35 and 0.175 s,
# 2-22x apart, past the margin of any early decision worth its risk.
CALIBRATION_BATCHES, CALIBRATION_SECONDS = 3, 10.0


class AutoCompile:
    """--torch-compile auto on one rank's shards: `current` (a Current) scores eager until the calibration batches
    are done; then the remaining eager scoring is estimated from their measured rate in the cost model's work (token
    equivalents of each batch: tokens alone misjudge long against short batches) and compile_choice decides. If it
    compiles, compiled_scorer proves the compiled forward on the probe's pairs against `probed`'s eager truth and the
    batches after score compiled; if the proof fails they go on eager, and say why. `computation`'s notes record
    the choice, and where compiled scoring began (`compiled_from`)."""

    clock = staticmethod(time.perf_counter)

    def __init__(self, model, shards: list[tuple[str, list[EncodedPair]]], mode: str, token_budget: int,
                 pad_id: int, top_k: int, probed: dict, computation: dict, log, device_type: str):
        hidden = getattr(model.config.get_text_config(), "hidden_size", 1024)
        self.costs = {file: batch_costs(pairs, mode, token_budget, hidden) for file, pairs in shards}
        self.files = [file for file, _ in shards]
        self.remaining = sum(map(sum, self.costs.values()))
        self.current, self.probed, self.computation, self.log = Current(model), probed, computation, log
        self.scoring = dict(mode=mode, pad_id=pad_id, top_k=top_k, token_budget=token_budget)
        self.device_type = device_type
        self.batches, self.work, self.seconds, self.shard, self.batch, self.mark = 0, 0.0, 0.0, None, 0, 0.0
        log(f"torch.compile auto: eager first; decides after {CALIBRATION_BATCHES + 1} batches and "
            f"{CALIBRATION_SECONDS:g} s of scoring, on their measured rate (a job done sooner stays eager)")

    def begin(self, file: str) -> None:
        """Shard `file`'s batches come next."""
        self.shard, self.batch, self.mark = file, 0, self.clock()

    def after_batch(self, *_completed) -> None:
        """score_pairs' on_batch: one more batch of the present shard scored."""
        now, cost = self.clock(), self.costs[self.shard][self.batch]
        self.batch, self.remaining = self.batch + 1, self.remaining - cost
        if self.probed is not None:
            self.batches += 1
            if self.batches > 1:  # the job's first batch is left out (one-time costs)
                self.work, self.seconds = self.work + cost, self.seconds + now - self.mark
            if self.batches > CALIBRATION_BATCHES and self.seconds >= CALIBRATION_SECONDS:
                self.decide()  # once: the clock is not read after it
        self.mark = now

    def finish(self) -> None:
        """After the last batch: a job done before its calibration says so (it stayed eager, deciding nothing)."""
        if self.probed is not None:
            self.probed = None
            self.log(f"torch.compile auto: stayed eager (the job's scoring was done after "
                     f"{counted(self.batches, 'batch', 'batches')}, {self.seconds:.1f} s measured past the first, before "
                     "the calibration: too short for compiling to pay)")

    def decide(self) -> None:
        probed, self.probed = self.probed, None  # decided once; the probe's truth is no longer needed
        rate = self.work / self.seconds
        eager, warm = max(self.remaining, 0.0) / rate, warm_cache()
        slowdown = cpu_slowdown() if eager else 1.0
        compile_it, why = compile_choice(None, eager, warm=warm, device_type=self.device_type, slowdown=slowdown)
        self.computation["compile_choice"] = why
        measured = (f"the first {counted(self.batches, 'batch', 'batches')} scored eager, the last "
                    f"{self.batches - 1} at {rate:,.0f} token equivalents/s over {self.seconds:.1f} s; "
                    f"{self.remaining:,.0f} left; " + estimate_text(eager, warm, self.device_type, slowdown))
        self.log(f"torch.compile {why} ({measured})")
        if not compile_it:
            return
        s = self.scoring
        model, used = compiled_scorer(self.current.model, s["mode"], probed["pairs"], s["pad_id"], s["top_k"],
                                      self.log, s["token_budget"], truth=probed["truth"])
        self.current.model, self.computation["compiled"] = model, used
        if used:
            shard, batch = self.shard, self.batch + 1
            if batch > len(self.costs[shard]):  # the shard is done: the next one's first batch
                shard, batch = self.files[self.files.index(shard) + 1], 1
            self.computation["compiled_from"] = {"shard": shard, "batch": batch, "eager_batches": self.batches}
