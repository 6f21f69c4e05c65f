"""Part 7: precompute batching modes side by side (precompute.modes.score_pairs on the same pairs and loaded model,
round-robin): full_forward, shared_prompt, packed, kv_cache and, with flash attention on CUDA, varlen; on a
long-prompt case (prompt 512, completions 128) and the standard case. Reported beside each: its per-token
difference against full_forward, the speed-up estimated_cost predicts (the basis of auto) and the mode auto picks.

    .venv/bin/python bench/bench_modes.py [--quick]
"""

from __future__ import annotations

import common
import measure
from common import np, torch

from precompute.modes import choose_mode, estimated_cost, score_pairs
from schemas.encoding import EncodedPair

MODES = ("full_forward", "shared_prompt", "packed", "kv_cache")


def long_prompt_pairs(n: int, vocab: int, prompt: int, completion: int, seed: int = 0) -> list[EncodedPair]:
    rng = np.random.default_rng(seed)
    ids = lambda k: [int(x) for x in rng.integers(3, vocab, size=k)]
    return [EncodedPair([1] + ids(prompt - 1), ids(completion - 1) + [2], ids(completion - 1) + [2]) for _ in range(n)]


def standard_pairs(n: int, vocab: int, seq: int, seed: int = 0) -> list[EncodedPair]:
    tok = common.word_tokenizer(vocab)
    out = []
    for row in common.synthetic_pairs(n, seq, vocab, seed):
        enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
        out.append(EncodedPair([1] + enc(row["prompt"]), enc(row["chosen"]) + [2], enc(row["rejected"]) + [2]))
    return out


def run_case(name: str, model, pairs: list[EncodedPair], token_budget: int, reps: int, modes=MODES) -> dict:
    results = {m: score_pairs(model, pairs, 0, token_budget, m) for m in modes}
    logps = lambda r: np.concatenate([s.logps for s in r[0] + r[1]])  # each completion's TokenScores
    reference = logps(results["full_forward"])
    diffs = {m: float(np.abs(logps(r) - reference).max()) for m, r in results.items()}
    times = measure.interleaved({m: (lambda m=m: score_pairs(model, pairs, 0, token_budget, m)) for m in modes},
                               reps=reps)
    tokens = results["full_forward"][2]["tokens"]
    hidden = model.config.hidden_size
    cost = {m: estimated_cost(pairs, m, token_budget, hidden) for m in modes}
    longest = max(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs)
    log = []
    auto = choose_mode(model, "auto", pairs, longest, 0, token_budget, log.append)
    fastest = min(modes, key=lambda m: times[m]["median"])
    case = {"name": name, "pairs": len(pairs), "tokens": tokens, "token_budget": token_budget, "auto": auto,
            "auto_log": log, "fastest": fastest, "auto_is_fastest": auto == fastest,
            "auto_vs_fastest": measure.ratio(times[fastest], times[auto]), "modes": {}}
    for m in modes:
        st = results[m][2]
        case["modes"][m] = {
            "time": times[m], "tokens_per_s": tokens / times[m]["median"],
            "speedup_vs_full_forward": measure.ratio(times["full_forward"], times[m]),
            "max_abs_diff_vs_full_forward": diffs[m],
            "padding_fraction": 1 - st["processed"] / st["slots"], "processed_tokens": st["processed"],
            "estimated_speedup": cost["full_forward"] / cost[m],
        }
    return case


def main():
    args = common.parser(__doc__).parse_args()
    common.quiet()
    dev = common.device()
    spec = "5M" if dev.type == "cpu" else "35M"
    model = common.build_llama(spec, vocab=common.MODELS[spec]["vocab"]).to(dev, common.torch_dtype(dev))
    modes = MODES
    if dev.type == "cuda" and flash_available():
        model.set_attn_implementation("flash_attention_2")
        modes = ("full_forward", "varlen", "kv_cache")  # the tree mask needs sdpa or eager
    vocab = common.MODELS[spec]["vocab"]
    n_long, n_std, reps = (8, 48, 2) if args.quick else (24, 128, 3)
    cases = [
        run_case("long prompt (512 + 128/128)", model, long_prompt_pairs(n_long, vocab, 512, 128), 8192, reps, modes),
        run_case("standard (synthetic, seq 256)", model, standard_pairs(n_std, vocab, 256), 8192, reps, modes),
    ]
    for case in cases:
        case.update(model=spec, params=common.n_params(model))
    if not args.quick:  # a model 7x larger: attention is a smaller share of the work, the prompt a larger one
        big = "35M" if dev.type == "cpu" else "350M"
        del model
        model = common.build_llama(big, vocab=common.MODELS[big]["vocab"]).to(dev, common.torch_dtype(dev))
        if modes != MODES:
            model.set_attn_implementation("flash_attention_2")
        case = run_case(f"long prompt (512 + 128/128), {big}", model,
                        long_prompt_pairs(12, common.MODELS[big]["vocab"], 512, 128), 8192, 2,
                        tuple(m for m in modes if m != "shared_prompt"))
        cases.append({**case, "model": big, "params": common.n_params(model)})
    result = {"model": spec, "params": common.n_params(model), "dtype": common.dtype_name(dev),
              "attn_implementation": model.config._attn_implementation, "cases": cases}
    path = common.save("modes", result, args)
    for case in cases:
        print(f"{case['name']}: {case['model']} model, {case['pairs']} pairs, {case['tokens']:,} tokens")
        for m, r in case["modes"].items():
            print(f"  {m:14s} {common.fmt_s(r['time'])}  {r['tokens_per_s']:,.0f} tok/s  "
                  f"x{r['speedup_vs_full_forward']:.2f} vs full_forward  max diff {r['max_abs_diff_vs_full_forward']:.1e}"
                  f"  padding {r['padding_fraction']:.1%}  estimated x{r['estimated_speedup']:.2f}")
        print(f"  auto picks {case['auto']}; fastest measured {case['fastest']} "
              f"(auto at {case['auto_vs_fastest']:.2f}x its speed)")
    print(f"wrote {path}")


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401  (availability probe)
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    with torch.no_grad():
        main()
