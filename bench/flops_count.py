"""Part 11's counting and inputs (bench_flops.py, bench_flops_jobs.py, bench_compile.py share them): the useful
FLOPs of encoded pairs (bench_flops.py's docstring says what is counted), the matmul the shares are taken against,
and the long-prompt case's synthetic pairs."""

from __future__ import annotations

from common import np, torch

MM = 2048
# counting

def model_shape(model) -> dict:
    cfg = model.config
    emb_in, emb_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    embeddings = {p.data_ptr(): p.numel() for p in (emb_in, emb_out)}
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)  # norms' vectors are no matmul
    return {"n_body": matrices - sum(embeddings.values()), "hidden": emb_out.shape[1],
            "vocab": emb_out.shape[0], "layers": cfg.num_hidden_layers, "attn_width": heads * head_dim}


def forward_flops(shape: dict, lengths: np.ndarray) -> dict:
    """Useful forward FLOPs of pairs with lengths [n, 3] (prompt, chosen, rejected), by part (see the docstring)."""
    P, C, R = (lengths[:, i].astype(np.float64) for i in range(3))
    tokens = P + C + R
    keys = P * (P + 1) / 2 + sum(X * P + X * (X + 1) / 2 for X in (C, R))
    head = 2 * shape["hidden"] * shape["vocab"]
    out = {"body": 2 * shape["n_body"] * tokens.sum(), "head": head * (C + R).sum(),
           "attention": 4 * shape["layers"] * shape["attn_width"] * keys.sum()}
    out["total"] = out["body"] + out["head"] + out["attention"]
    out["head_every_token"] = out["total"] - out["head"] + head * tokens.sum()
    return out


@torch.no_grad()
def matmul_check(model, pair) -> dict:
    """The matmul FLOPs torch's own FlopCounterMode counts in a forward over one unpadded sequence (prompt + chosen,
    logits at every position) against this count's body + head at every token: an independent check of N."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.as_tensor([pair.prompt_ids + pair.chosen_ids], device=next(model.parameters()).device)
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=False)
    counted = sum(v for k, v in counter.get_flop_counts()["Global"].items() if "mm" in str(k))
    f = forward_flops(model_shape(model), np.array([[len(pair.prompt_ids), len(pair.chosen_ids), 0]]))
    return {"flop_counter_matmuls": counted, "ours": f["head_every_token"] - f["attention"]}


def pair_lengths(pairs) -> np.ndarray:
    return np.array([[len(p.prompt_ids), len(p.chosen_ids), len(p.rejected_ids)] for p in pairs], dtype=np.int64)


def encoded_pairs(a) -> tuple:
    """The case's train pairs as precompute-ref encodes them: (encoding, pairs, pad id)."""
    from runtime.checkpoint import load_tokenizer
    from runtime.data import encode_rows, load_rows
    from schemas.encoding import EncodingConfig

    encoding = EncodingConfig(max_length=a.seq) if a.seq else EncodingConfig()
    tok = load_tokenizer(a.model)
    pairs = encode_rows(load_rows(a.data, "train"), tok, encoding).pairs
    return encoding, pairs, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def mm_fn(dtype, dev):
    a = torch.randn(MM, MM, dtype=dtype, device=dev)
    b = torch.randn(MM, MM, dtype=dtype, device=dev)
    return lambda: torch.mm(a, b)


MM_FLOPS = 2 * MM**3


def long_prompt_rows(n: int, vocab: int, prompt: int, completion: int, seed: int = 0) -> list[dict]:
    """Pairs of exactly `prompt` prompt words and `completion` words per completion (EOS included), word tokenizer."""
    rng = np.random.default_rng(seed)
    words = lambda k: " ".join(f"w{i}" for i in rng.integers(3, vocab, size=k))
    return [{"id": f"p{i:04d}", "prompt": words(prompt), "chosen": " " + words(completion - 1),
             "rejected": " " + words(completion - 1)} for i in range(n)]

