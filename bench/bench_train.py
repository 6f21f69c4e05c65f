"""Part 2: train-dpo step time and peak memory: cached reference vs live reference vs policy-only vs TRL.

One process per configuration (train_steps' child harness), the same model, data, batch and precision:
  policy   the limit: the same Trainer, collator and forward/backward, the DPO loss against a constant zero reference
  cached   train-dpo --ref-cache (dpo.recipe.run_train): verifies the cache, never loads the reference
  live     train-dpo --ref-model: a second copy of the model, one extra no-grad forward per step
  trl      trl.DPOTrainer with a live reference model

    .venv/bin/python bench/bench_train.py [--quick]
"""

from __future__ import annotations

import json

import common
import measure
import train_steps as steps
from common import torch

# rounds: every configuration runs once per round, in turn, so that load from other processes on a shared machine
# falls on all of them alike; step times are pooled over the rounds.
QUICK = dict(model="5M", seq=256, batch=4, warmup=1, steps=3, rounds=2)
FULL = dict(model="35M", seq=512, batch=2, warmup=1, steps=3, rounds=2)
GPU = dict(model="350M", seq=1024, batch=8, warmup=3, steps=10, rounds=2)
MODES = ("policy", "cached", "live", "trl")


def run_policy(a, timer, out: str) -> dict:
    """policy-only: what run_train builds, minus every reference value (a constant zero reference)."""
    import datasets
    from transformers import AutoModelForCausalLM

    from dpo.trainer import DPOTrainer, PairCollator, disable_dropout
    from dpo.verify import encode_only
    from runtime.checkpoint import load_tokenizer
    from schemas.encoding import EncodingConfig

    class PolicyOnly(DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            zeros = torch.zeros(int(inputs["completion_lens"].sum()), device=inputs["input_ids"].device)
            return super().compute_loss(model, {**inputs, "ref_logps": zeros}, return_outputs, num_items_in_batch)

    cfg = steps.train_config(a, "policy", out)
    tok = load_tokenizer(a.model)
    rows = encode_only(tokenizer=tok, data=a.data, split="train", encoding=EncodingConfig(max_length=a.seq))
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    policy = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, use_safetensors=True)
    disable_dropout(policy)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    trainer = PolicyOnly(model=policy, args=cfg.training_arguments(), data_collator=PairCollator(pad_id),
                         train_dataset=datasets.Dataset(rows.table), processing_class=tok, callbacks=[timer],
                         loss_config=cfg.loss_config(), ref_model=None)
    trainer.train()
    return {}


RUNNERS = {"policy": run_policy, "cached": lambda a, timer, out: steps.run_ours(a, "cached", timer, out),
           "live": lambda a, timer, out: steps.run_ours(a, "live", timer, out), "trl": steps.run_trl}


def main():
    ap = common.child_parser(__doc__, MODES)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(steps.child(args, RUNNERS)))
        return

    common.quiet()
    dev = common.device()
    size = GPU if dev.type == "cuda" else (QUICK if args.quick else FULL)
    if dev.type == "cuda" and args.quick:
        size = {**size, "model": "35M", "warmup": 2, "steps": 5}
    with common.workdir("train") as work:
        model_dir, data, cache, info = steps.prepare(size, work)
        modes = [m for m in MODES if m != "trl" or common.has_trl()]
        argv = lambda mode, size=size, **more: steps.child_argv(__file__, size, model_dir, data, cache, work, mode, **more)
        rounds = common.rounds(size["rounds"], modes, argv, steps.step_line)
        runs = {m: steps.summarize(v) for m, v in rounds.items()}
        steps.show_runs(runs)
        p, c, l = runs["policy"], runs["cached"], runs["live"]
        res = {
            "size": size, "params": common.n_params(common.build_llama(size["model"])), **info, "runs": runs,
            "ratio_cached_vs_policy": measure.ratio(c["step"], p["step"]),
            "ratio_cached_vs_live": measure.ratio(c["step"], l["step"]),
            "mem_cached_vs_policy": c["maxrss_mb"] / p["maxrss_mb"],
            "mem_steady_cached_vs_policy": c["step_peak"]["median"] / p["step_peak"]["median"],
            "mem_cached_vs_live": c["maxrss_mb"] / l["maxrss_mb"],
        }
        if dev.type == "cuda":
            res["cuda_mem_cached_vs_policy"] = c["cuda_peak_mb"] / p["cuda_peak_mb"]
            res["cuda_mem_cached_vs_live"] = c["cuda_peak_mb"] / l["cuda_peak_mb"]
        if "trl" in runs:
            res["ratio_cached_vs_trl"] = measure.ratio(c["step"], runs["trl"]["step"])
            res["mem_cached_vs_trl"] = c["maxrss_mb"] / runs["trl"]["maxrss_mb"]
        # A missed step-time target: profile the configurations involved (a separate run: the profiler slows steps).
        missed = []
        if res["ratio_cached_vs_policy"] > 1.05:
            missed += ["policy", "cached"]
        if res["ratio_cached_vs_live"] > 0.75:
            missed += ["cached", "live"]
        res["profiles"] = {}
        for mode in dict.fromkeys(missed):
            r = common.run_child(argv(mode, {**size, "warmup": 1, "steps": 2, "rounds": 1}, profile=True))
            res["profiles"][mode] = r.get("profile")
            print(f"profiled {mode}", flush=True)
        print(f"cached/policy {res['ratio_cached_vs_policy']:.3f}x  cached/live {res['ratio_cached_vs_live']:.3f}x  "
              f"memory cached/policy {res['mem_cached_vs_policy']:.3f}x", flush=True)
    print(f"wrote {common.save('train', res, args)}")


if __name__ == "__main__":
    main()
