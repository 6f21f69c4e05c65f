"""refcache against TRL's DPOTrainer on the same rows (needs the `bench` extra: trl).

For the three preference formats and two tokenizers (GPT-2 style: no BOS; Llama style: BOS and chat template), on a
tiny Llama built here: token ids per row, refcache's against TRL's, identical or identical once TRL's post-EOS
template tokens are set aside; the first-step loss and 10 steps of the metrics both log, refcache trained on a cache,
TRL with its live reference (and, where TRL's ids carry post-EOS tokens, also without them: "aligned").

    python bench/compare_trl.py [--rows 16] [--steps 10] [--json bench/results/trl-compare-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import common  # the bench's environment: offline, a private HF_HOME removed at exit

sys.path.insert(0, str(common.REPO / "tests"))
from conftest import build_llama, pref_rows, save_checkpoint, write_jsonl
from support import gpt2_style, llama_style

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
           "grad_norm")
# A share of pairs, so a step's value moves in steps of 1/batch: a pair whose two rewards are equal to float32
# rounding can count on one side and not the other. Reported, not held to the 1e-4 bound.
STEPWISE = ("rewards/accuracies",)
COMMON = dict(learning_rate=1e-3, per_device_train_batch_size=4, logging_steps=1, seed=42, use_cpu=True,
              bf16=False, fp16=False, gradient_checkpointing=False, report_to="none", lr_scheduler_type="linear",
              warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch")


def refcache_ids(model_dir, data):
    from runtime.checkpoint import load_tokenizer
    from runtime.data import encode_rows, load_rows
    from schemas.encoding import EncodingConfig

    enc = encode_rows(load_rows(data), load_tokenizer(str(model_dir)), EncodingConfig())
    return [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in enc.pairs]


def run_refcache(model_dir, data, work, steps):
    from dpo.config import TrainConfig
    from dpo.recipe import run_train
    from precompute.job import PrecomputeConfig, run_precompute

    cache = work / "cache"
    run_precompute(PrecomputeConfig(model=str(model_dir), data=str(data), out=str(cache), progress=False),
                   log=lambda m: None)
    out = work / "refcache-run"
    cfg = TrainConfig(model=str(model_dir), data=str(data), output_dir=str(out), ref_cache=str(cache), beta=0.1,
                      max_steps=steps, save_strategy="no", plot=False, **COMMON)
    run_train(cfg, log=lambda m: None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r and "train_loss" not in r}


def _strip_post_eos(ids, eos):
    return ids[: len(ids) - ids[::-1].index(eos)] if eos in ids else ids


def run_trl(model_dir, rows, work, steps, aligned):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = DPOConfig(output_dir=str(work / f"trl-{aligned}"), beta=0.1, max_steps=steps, save_strategy="no",
                     max_length=1024, loss_type=["sigmoid"], disable_tqdm=True, **COMMON)
    data = Dataset.from_list([{k: v for k, v in r.items() if k != "id"} for r in rows])
    trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    ids = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in trainer.train_dataset]
    if aligned:
        eos = tok.eos_token_id
        trainer.train_dataset = trainer.train_dataset.map(lambda r: {
            "chosen_ids": _strip_post_eos(r["chosen_ids"], eos), "rejected_ids": _strip_post_eos(r["rejected_ids"], eos)})
    trainer.train()
    logs = {r["step"]: r for r in trainer.state.log_history if "loss" in r}
    return ids, logs, tok.eos_token_id


def compare_ids(ours, theirs, eos):
    exact = post_eos = differ = 0
    for (p, c, r), (tp, tc, tr) in zip(ours, theirs):
        if (p, c, r) == (list(tp), list(tc), list(tr)):
            exact += 1
        elif (p, c, r) == (list(tp), _strip_post_eos(list(tc), eos), _strip_post_eos(list(tr), eos)):
            post_eos += 1
        else:
            differ += 1
    return {"rows": len(ours), "trl_rows": len(theirs), "identical": exact, "identical_but_trl_post_eos": post_eos,
            "different": differ}


def compare_metrics(ours, theirs):
    steps = sorted(set(ours) & set(theirs))
    diff = {m: max(abs(ours[s][m] - theirs[s][m]) for s in steps) for m in METRICS
            if all(m in ours[s] and m in theirs[s] for s in steps)}
    stepwise = {m: [s for s in steps if ours[s].get(m) != theirs[s].get(m)] for m in STEPWISE}
    return {"steps": len(steps), "first_step_loss": [ours[steps[0]]["loss"], theirs[steps[0]]["loss"]],
            "steps_where_differs": stepwise,
            "first_step_loss_diff": abs(ours[steps[0]]["loss"] - theirs[steps[0]]["loss"]), "max_abs_diff": diff}


def one_case(fmt, tok_name, rows_n, steps, root):
    tok = {"gpt2_style": gpt2_style, "llama_style": llama_style}[tok_name]()
    work = root / f"{fmt}-{tok_name}"
    model_dir = save_checkpoint(build_llama(len(tok)), tok, work / "model")
    rows = pref_rows(rows_n, fmt=fmt)
    data = write_jsonl(work / "prefs.jsonl", rows)
    ours_ids = refcache_ids(model_dir, data)
    ours = run_refcache(model_dir, data, work, steps)
    trl_ids, trl_logs, eos = run_trl(model_dir, rows, work, steps, aligned=False)
    result = {"format": fmt, "tokenizer": tok_name, "ids": compare_ids(ours_ids, trl_ids, eos),
              "metrics": compare_metrics(ours, trl_logs)}
    if result["ids"]["identical_but_trl_post_eos"]:
        _, aligned_logs, _ = run_trl(model_dir, rows, work, steps, aligned=True)
        result["metrics_aligned"] = compare_metrics(ours, aligned_logs)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default=None)
    a = parser.parse_args()
    common.quiet()
    results = []
    with common.workdir("trl-compare") as tmp:
        for tok_name in ("gpt2_style", "llama_style"):
            for fmt in ("standard", "conversational", "implicit"):
                r = one_case(fmt, tok_name, a.rows, a.steps, tmp)
                results.append(r)
                m = r.get("metrics_aligned", r["metrics"])
                print(f"{tok_name:12s} {fmt:15s} ids identical {r['ids']['identical']}/{r['ids']['rows']}, "
                      f"identical but TRL's post-EOS tokens {r['ids']['identical_but_trl_post_eos']}, different "
                      f"{r['ids']['different']}; first-step loss diff {r['metrics']['first_step_loss_diff']:.2e}; "
                      f"max {a.steps}-step metric diff{' (aligned)' if 'metrics_aligned' in r else ''} "
                      f"{max(m['max_abs_diff'].values()):.2e} ({max(m['max_abs_diff'], key=m['max_abs_diff'].get)})",
                      flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")
    ok = all(r["ids"]["different"] == 0 and r["metrics"]["first_step_loss_diff"] <= 1e-6
             and max(r.get("metrics_aligned", r["metrics"])["max_abs_diff"].values()) <= 1e-4 for r in results)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
