"""Architecture matrix: every batching mode (and auto) gives the model's own numbers, or falls back / refuses.
Cross-cutting (runtime.head, runtime.logprobs and precompute.modes over one model per architecture), so top level.

The truth is `runtime.logprobs.reference_logps`: the model's own forward over the unpadded sequence as a batch of one,
its own `logits` after log_softmax. For each architecture below a tiny random model is built from its config (weights
drawn larger than the default initialisation, so that position and context errors are visible: a one-token shift of
the prompt must move the completion's log-probs by far more than the tolerance), five pairs with short and long
prompts are scored in one job, and for every requested mode the mode precompute-ref would run (after its probe) must
reproduce the truth within the guarantee's tolerance in float32 (runtime/tolerance.py: 1e-4 per token, what the probe
itself admits), or the job must refuse with JobError.

Architectures of transformers 5.24's causal-LM mapping left out, and why (the sets below):
  SLOW: a tiny model still takes seconds to build or run here (many experts by default, or pure-torch kernels);
  BROKEN_TINY: the generic shrinking gives a config the model code cannot run (shape errors; error seen noted);
  ENCODERS: encoder stacks usable as decoders via is_decoder (bert family, xlm, xlnet, electra, ...), not
  decoder-only LMs; multimodal, audio, OCR and encoder-decoder classes (fuyu, moshi, trocr, git, mllama, gemma3,
  got_ocr2, ...): not text decoder-only.
SWEEP_ONLY state-space/hybrid models take a few seconds each: they run with REFCACHE_ARCH_SWEEP=1, which also runs
every architecture in bfloat16 (against a bfloat16 reference forward) and prints the architecture x mode table
(`pytest tests/test_architectures.py -s`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np
import pytest
import torch

from precompute import MODES
from precompute.modes import choose_mode, score_pairs, shape_dependent, unsupported
from runtime.errors import JobError
from runtime.logprobs import verified_head
from runtime.logprobs import reference_logps
from runtime.tolerance import probe_tolerance
from schemas.encoding import EncodedPair

SWEEP = os.environ.get("REFCACHE_ARCH_SWEEP") == "1"
# the product's guarantee, the one policy (a stricter figure here failed modes the probe rightly admits: hyperclovax's
# packed rows, 1.1e-5 from the truth in float32)
TOLERANCE = probe_tolerance("float32")
VOCAB = 300
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, vocab_size=VOCAB, max_position_embeddings=512, n_embd=32, n_layer=2, n_head=4,
             n_positions=512, d_model=32, word_embed_proj_dim=32, num_layers=2, ffn_dim=64, n_inner=64, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, tie_word_embeddings=False)
ROPE_THRESHOLD = 32  # original context of the dynamic / longrope variants: the long pairs go past it

MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_state": 16, "mamba_chunk_size": 16, "mamba_expand": 2}
# name -> (model_type, config overrides)
ARCHITECTURES = {
    "llama_dynamic_rope": ("llama", {"rope_parameters": {
        "rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0,
        "original_max_position_embeddings": ROPE_THRESHOLD}}),
    "phi3_longrope": ("phi3", {"original_max_position_embeddings": ROPE_THRESHOLD, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [3.0] * 4,
        "original_max_position_embeddings": ROPE_THRESHOLD}}),
    "falcon_alibi": ("falcon", {"alibi": True}),
    "apertus": ("apertus", {}),
    "arcee": ("arcee", {}),
    "bloom": ("bloom", {}),
    "cohere": ("cohere", {}),
    "cohere2": ("cohere2", {}),
    "ctrl": ("ctrl", {}),
    "cwm": ("cwm", {}),
    "diffllama": ("diffllama", {}),
    "doge": ("doge", {}),
    "exaone": ("exaone", {}),
    "exaone4": ("exaone4", {}),
    "falcon": ("falcon", {}),
    "falcon_mamba": ("falcon_mamba", {}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", {}),
    "gemma3_text": ("gemma3_text", {}),
    "glm": ("glm", {}),
    "glm4": ("glm4", {}),
    "gpt2": ("gpt2", {}),
    "gpt_bigcode": ("gpt_bigcode", {}),
    "gpt_neo": ("gpt_neo", {}),
    "gpt_neox": ("gpt_neox", {}),
    "gpt_neox_japanese": ("gpt_neox_japanese", {}),
    "granite": ("granite", {"logits_scaling": 4.0}),
    "helium": ("helium", {}),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", {}),
    "hyperclovax": ("hyperclovax", {"logits_scaling": 4.0}),
    "jais2": ("jais2", {}),
    "lfm2": ("lfm2", {}),
    "llama": ("llama", {}),
    "mamba": ("mamba", {}),
    "ministral": ("ministral", {}),
    "mistral": ("mistral", {}),
    "mpt": ("mpt", {}),
    "nemotron": ("nemotron", {}),
    "olmo": ("olmo", {}),
    "olmo2": ("olmo2", {}),
    "olmo3": ("olmo3", {}),
    "openai-gpt": ("openai-gpt", {}),
    "opt": ("opt", {}),
    "persimmon": ("persimmon", {}),
    "phi": ("phi", {}),
    "phi3": ("phi3", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "recurrent_gemma": ("recurrent_gemma", {"lru_width": 32, "attention_window_size": 256, "logits_soft_cap": 5.0}),
    "seed_oss": ("seed_oss", {}),
    "smollm3": ("smollm3", {}),
    "stablelm": ("stablelm", {}),
    "starcoder2": ("starcoder2", {}),
    "vaultgemma": ("vaultgemma", {}),
    "xglm": ("xglm", {}),
    "ernie4_5": ("ernie4_5", {}),
    "falcon_h1": ("falcon_h1", {**MAMBA2, "mamba_d_ssm": 64, "lm_head_multiplier": 0.5}),
    "jamba": ("jamba", {"num_experts": 4, "mamba_dt_rank": 8}),
    "bamba": ("bamba", MAMBA2),
    "qwen3_next": ("qwen3_next", {"linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                                  "linear_num_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    "granitemoehybrid": ("granitemoehybrid", {**MAMBA2, "num_local_experts": 4}),
}

ENCODERS = {"bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
            "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm", "xlm-roberta",
            "xlm-roberta-xl", "xlnet", "xmod", "cpmant"}
SLOW = {"afmoe", "blt", "inkling_text", "longcat_flash", "mimo_v2_flash", "zamba2", "kolibri1", "laguna", "lara_mini",
        "mellum", "olmoe", "qwen2_moe", "qwen3_moe", "glm4_moe", "solar_open", "hy_v3", "zaya", "jetmoe", "minimax",
        "iquestcoder", "inkling2_text"}
# Run only with REFCACHE_ARCH_SWEEP=1 (a few seconds each: pure-torch state-space scans)
SWEEP_ONLY = {"jamba", "granitemoehybrid", "qwen3_next", "bamba", "falcon_mamba", "mamba"}
BROKEN_TINY = {
    "axk1": "RuntimeError: size of tensor a (32) must match b (4)",
    "codegen": "RuntimeError: size of tensor a (8) must match b (64)",
    "zamba": "RuntimeError: size of tensor a (7424) must match b (64) (mamba sizes not derived from hidden_size)",
    "deepseek_v2": "RuntimeError: size of tensor a (32) must match b (4) (MLA dims; also deepseek_v3, v32, "
                   "glm_moe_dsa, sarvam_mla, youtu, axk2, minicpm3, glm4_moe_lite)",
    "gptj": "RuntimeError: size of tensor a (8) must match b (64) (rotary_dim)",
    "mamba2": "RuntimeError: shape invalid for input (head sizes)",
    "rwkv": "RuntimeError: size of tensor a (32) must match b (4096) (attention_hidden_size)",
    "xlstm": "RuntimeError: size of tensor a (4096) must match b (32)",
    "dbrx": "AttributeError: DbrxAttentionConfig has no rope_theta",
    "dots1": "TypeError: empty() takes 1 positional argument but 3 were given",
    "dots3_note_text, gemma4_text": "AmbiguousGlobalPerLayerAttributeError: per-layer head sizes",
    "gemma3n_text": "IndexError: list assignment index out of range (per-layer inputs)",
    "hrm_text": "IndexError: list index out of range",
    "lfm2_moe": "TypeError: 'NoneType' object is not subscriptable",
    "reformer": "needs is_decoder=True and chunked-attention sizes",
}
SHAPE_DEPENDENT = {"llama_dynamic_rope", "phi3_longrope", "bloom", "falcon_alibi", "mpt"}  # must run `single`


def build(name: str, dtype=torch.float32):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    model_type, overrides = ARCHITECTURES[name]
    config = CONFIG_MAPPING[model_type]()
    text = config.get_text_config()
    for key, value in {**SMALL, **overrides}.items():
        if key in overrides or hasattr(text, key):
            try:
                setattr(text, key, value)
            except AttributeError:  # a derived property (e.g. Falcon's head_dim)
                pass
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():  # larger weights: positions and context must show
            if p.ndim == 2 and pname.endswith("weight"):
                p.normal_(0.0, 0.25)
    return model.to(dtype).eval().requires_grad_(False)


def job_pairs() -> list[EncodedPair]:
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(3, VOCAB, n).tolist()
    return [EncodedPair(ids(p), ids(c), ids(r)) for p, c, r in
            ((2, 3, 1), (5, 7, 4), (9, 1, 12), (40, 6, 9), (75, 12, 5))]  # short and long prompts in one job


def truth(model, pairs):
    return [reference_logps(model, p.prompt_ids, c).numpy() for p in pairs for c in (p.chosen_ids, p.rejected_ids)]


def score(model, pairs, mode) -> list[np.ndarray] | None:
    """Every sequence's completion log-probs in `mode` (a small budget: several batches of mixed widths), or None
    where the model's forward rejects what the mode feeds it."""
    try:
        chosen, rejected, _ = score_pairs(model, pairs, 0, 64, mode)
    except Exception:
        return None
    return [x.logps for pair in zip(chosen, rejected) for x in pair]


def worst(got, ref) -> float:
    if got is None or len(got) != len(ref):  # a missing sequence is as wrong as a wrong one
        return float("inf")
    return max(float(np.max(np.abs(g - t), initial=0.0)) if g.shape == t.shape else float("inf")
               for g, t in zip(got, ref))


def chosen_mode(model, requested: str, pairs) -> str:
    """What precompute-ref runs for --batching `requested` (after its probe), or 'refused'."""
    longest = max(pairs, key=lambda p: len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)))
    try:
        return choose_mode(model, requested, pairs, len(longest.prompt_ids) + max(len(longest.chosen_ids),
                           len(longest.rejected_ids)), 0, 256, lambda _m: None, long_pairs=[longest])
    except JobError:
        return "refused"


def matrix_row(model, pairs, tolerance: float, ref=None) -> dict:
    """requested mode -> (mode run, worst difference from the truth over the whole job). A mode is scored directly;
    one that is off must be turned down by precompute-ref's own choice, and what it runs instead must be right."""
    ref = truth(model, pairs) if ref is None else ref
    diffs = {m: worst(score(model, pairs, m), ref) for m in MODES}
    row = {}
    for requested in ("auto",) + MODES:
        direct = requested != "auto" and diffs[requested] <= tolerance and unsupported(requested, model, 99) is None
        ran = requested if direct else chosen_mode(model, requested, pairs)
        row[requested] = (ran, 0.0 if ran == "refused" else diffs[ran])
    return row


RESULTS: dict = {}


@pytest.mark.parametrize("name", [n for n in sorted(ARCHITECTURES) if SWEEP or n not in SWEEP_ONLY])
def test_every_mode_reproduces_the_reference_forward(name):
    model = build(name)
    pairs = job_pairs()
    ref = truth(model, pairs)
    shifted = [reference_logps(model, [7] + p.prompt_ids, c).numpy() for p in pairs for c in (p.chosen_ids, p.rejected_ids)]
    moved = max(float(np.abs(a - b).max()) for a, b in zip(ref, shifted))
    assert moved > 100 * TOLERANCE, f"{name}: a one-token shift moves the log-probs by only {moved:.1e}"
    row = matrix_row(model, pairs, TOLERANCE, ref)
    for requested, (ran, diff) in row.items():
        assert diff <= TOLERANCE, f"{name}: --batching {requested} ran {ran}, off by {diff:.2e}"
    if name in SHAPE_DEPENDENT:
        assert row["auto"][0] == "single", f"{name}: {shape_dependent(model, 99)}, yet auto ran {row['auto'][0]}"
    RESULTS[name] = {"float32": row, "head": verified_head(model), "attn": model.config._attn_implementation,
                     "moved": moved}
    if SWEEP:
        RESULTS[name]["bfloat16"] = matrix_row(build(name, torch.bfloat16), pairs, 0.25)


def test_heads_that_post_process_their_logits_use_the_models_own_head():
    """Models whose causal-LM forward scales or soft-caps the projected logits cannot take the hook projection."""
    assert verified_head(build("llama")) == "hook"
    for name in ("cohere", "hyperclovax", "falcon_h1", "recurrent_gemma", "gemma2", "granite"):  # scale / soft-cap
        assert verified_head(build(name)) == "logits_to_keep", name
    assert verified_head(build("opt")) != "hook"  # its causal-LM class calls model.decoder: the hook never runs


@pytest.fixture(scope="module", autouse=True)
def table():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only waits (badly so on a shared machine)
    yield
    torch.set_num_threads(threads)
    if not SWEEP or not RESULTS:
        return
    print("\narchitecture | head | attn | shift | " + " | ".join(("auto",) + MODES))
    for name, r in sorted(RESULTS.items()):
        for dt in ("float32", "bfloat16"):
            if dt in r:
                cells = [f"{ran} {diff:.1e}" for ran, diff in (r[dt][m] for m in ("auto",) + MODES)]
                print(f"{name} [{dt}] | {r['head']} | {r['attn']} | {r['moved']:.2f} | " + " | ".join(cells))


def test_attention_defaults_to_what_transformers_picks(tmp_path):
    """bloom has no sdpa: asked for it, the load is refused naming what it supports; by default it loads."""
    from precompute.job import PrecomputeConfig, load_model_for

    build("bloom").save_pretrained(tmp_path / "bloom")
    cfg = PrecomputeConfig(model=str(tmp_path / "bloom"), data="-", attn_implementation="sdpa")
    with pytest.raises(JobError, match=r"--attn-implementation sdpa .*it supports: eager"):
        load_model_for(cfg, torch.float32, torch.device("cpu"))
    cfg.attn_implementation = "auto"
    assert load_model_for(cfg, torch.float32, torch.device("cpu")).config._attn_implementation == "eager"


def test_probe_sees_errors_that_only_long_sequences_show(monkeypatch):
    """A mode that is exact on short rows and wrong deep into long ones (as ALiBi in bf16 over a packed row was) is
    turned down: the probe scores the job's longest pair whole, against the reference forward."""
    from precompute import modes
    from precompute.modes import kv_cache

    model = build("llama")
    pairs = job_pairs()
    real = kv_cache.kv_cache_batch

    def drifts_when_long(model, pairs_, batch, pad_id, top_k=0):
        values, counts = real(model, pairs_, batch, pad_id, top_k)
        long = [len(pairs_[i].prompt_ids) > 30 for i in batch for _ in (0, 1)]
        drift = [dataclasses.replace(v, logps=v.logps + (0.01 if is_long else 0.0)) for v, is_long in zip(values, long)]
        return drift, counts

    monkeypatch.setattr(kv_cache, "kv_cache_batch", drifts_when_long)
    messages = []
    longest = max(pairs, key=lambda p: len(p.prompt_ids))
    assert choose_mode(model, "kv_cache", pairs, 99, 0, 256, messages.append, long_pairs=[longest]) == "full_forward"
    assert "kv_cache: differs from the reference forward by 1.00e-02" in messages[0]
    assert modes.probe_pairs(pairs[:3]) and all(len(p.prompt_ids) <= 30 for p in modes.probe_pairs(pairs[:3]))
