"""One TRL DPO run as a user would write it, for bench_sweep.py: TRL's DPOTrainer in its faster mode,
`precompute_ref_log_probs=True` with no ref_model (the reference log-probs are computed from the initial policy in
`__init__`, so no second model is kept for training), CPU float32. Run in a process of its own:

    python bench/sweep_trl.py MODEL DATA.jsonl OUT_DIR BETA MAX_STEPS BATCH MAX_LENGTH PHASES.json

It writes the wall and CPU seconds of its phases to PHASES.json (start-up = interpreter and imports)."""

import json
import os
import sys
import time


def _process_age_s():
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")


def main(model_path, data, out, beta, max_steps, batch, max_length, phases_path):
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    phases = {"startup": {"wall_s": _process_age_s(), "cpu_s": time.process_time()}}
    last = [time.perf_counter(), time.process_time()]

    def mark(name):
        wall, cpu = time.perf_counter(), time.process_time()
        phases[name] = {"wall_s": wall - last[0], "cpu_s": cpu - last[1]}
        last[:] = [wall, cpu]

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    mark("load")
    dataset = datasets.load_dataset("json", data_files=data, split="train")
    args = DPOConfig(
        output_dir=out, beta=float(beta), max_steps=int(max_steps), per_device_train_batch_size=int(batch),
        max_length=int(max_length), precompute_ref_log_probs=True, seed=42, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, report_to="none",
    )
    trainer = DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    mark("setup")  # data set loading, tokenization and TRL's reference precompute (in __init__)
    result = trainer.train()
    mark("train")
    trainer.save_model(out)
    mark("save")
    with open(phases_path, "w") as f:
        json.dump({"phases": phases, "train_runtime": result.metrics.get("train_runtime"),
                   "steps": result.global_step, "train_loss": result.training_loss}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
