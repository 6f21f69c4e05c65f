"""TRL's DPO example shape (DPOConfig, DPOTrainer, train, save), changed by the import and `ref_cache=`: launched under
torchrun by tests/dpo/test_trl_entry.py. argv: data.jsonl cache output_dir trainer (`refcache` or `trl`, TRL's own
with precompute_ref_log_probs)."""

import json
import sys

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig

data, cache, out, which = sys.argv[1:5]
model_dir = sys.argv[5]
if which == "refcache":
    from dpo.trl import DPOTrainer
else:
    from trl import DPOTrainer

model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
train_dataset = load_dataset("json", data_files=data, split="train")
args = DPOConfig(output_dir=out, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", max_steps=2,
                 per_device_train_batch_size=2, logging_steps=1, save_strategy="no", learning_rate=1e-3, seed=0,
                 precompute_ref_log_probs=which == "trl")
extra = {"ref_cache": cache} if which == "refcache" else {}
trainer = DPOTrainer(model=model, args=args, train_dataset=train_dataset, processing_class=tokenizer, **extra)
trainer.train()
trainer.save_model(out)
if trainer.is_world_process_zero():
    print("LOG " + json.dumps([r for r in trainer.state.log_history if "loss" in r]))
    print(f"WORLD {trainer.args.world_size}")
# A rank that leaves while rank 0 still writes the model can abort in gloo's teardown ("terminate called without an
# active exception", exit -6, after training succeeded): every rank waits for the others, then ends the job as
# accelerate documents (end_training destroys the process group).
trainer.accelerator.wait_for_everyone()
trainer.accelerator.end_training()
