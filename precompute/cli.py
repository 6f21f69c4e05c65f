"""Command line of precompute-ref."""

from __future__ import annotations

import os
import click

from precompute import MODES
from runtime.cli import encoding_from, encoding_options, quiet_libraries, run_cli

@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False),
              help="Reference checkpoint folder (safetensors weights, config.json, tokenizer).")
@click.option("--data", required=True, type=click.Path(exists=True),
              help="Preference data: a .jsonl/.json/.parquet/.csv file, a folder of them, or a save_to_disk folder.")
@click.option("--out", default="ref-cache", type=click.Path(file_okay=False), help="Cache directory to write.")
@click.option("--split", default="train", help="Split to read from a folder or a DatasetDict.")
@encoding_options
@click.option("--token-budget", default=16384, type=click.IntRange(min=1),
              help="Padded tokens per forward batch (batch size x longest sequence).")
@click.option("--rows-per-shard", default=2048, type=click.IntRange(min=1), help="Pairs per Parquet shard.")
@click.option("--dtype", default="auto", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              help="Reference precision; auto is bfloat16 on CUDA and float32 on CPU.")
@click.option("--device", default="auto", help="auto (CUDA device LOCAL_RANK if present, else CPU), cpu, cuda, cuda:N.")
@click.option("--attn-implementation", default="auto",
              help="Attention kernel: auto (what transformers picks for the model), sdpa, eager, flash_attention_2.")
@click.option("--batching", default="auto", type=click.Choice(("auto",) + MODES),
              help="How pairs go through the model (same numbers either way). kv_cache: each prompt once, chosen "
                   "and rejected continue from its key/value cache; packed: prompt once, pairs packed into rows with "
                   "a tree mask; shared_prompt: the same, one pair per row; varlen: sequences packed without padding "
                   "(flash attention); full_forward: [prompt|chosen] and [prompt|rejected] as padded rows; single: one "
                   "unpadded sequence per forward. auto estimates the work of each mode the attention supports on the "
                   "first shard and takes the cheapest. Every mode is first checked against the model's plain "
                   "forward of single sequences on real pairs (the longest included) and falls back if it differs; "
                   "models whose numbers depend on batch shape (ALiBi, dynamic/longrope RoPE) run single.")
@click.option("--resume/--overwrite", default=True,
              help="Resume: keep finished shards of this same job. Overwrite: delete the existing cache first.")
@click.option("--on-bad-row", default="error", type=click.Choice(["error", "skip"]),
              help="error: stop at the first bad row (exit 2). skip: leave it out and list it in skipped.jsonl.")
@click.option("--trust-remote-code", is_flag=True, help="Allow custom model code from the checkpoint folder.")
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def main(model, data, out, split, max_length, truncation_mode, chat_template, token_budget, rows_per_shard, dtype,
         device, attn_implementation, batching, resume, on_bad_row, trust_remote_code, no_progress, debug):
    """Run the frozen reference model once over preference pairs and write per-token log-probs to a stamped,
    resumable Parquet cache for train-dpo."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def body():
        from .job import PrecomputeConfig, run_precompute

        quiet_libraries()
        cfg = PrecomputeConfig(
            model=model, data=data, out=out, split=split,
            encoding=encoding_from(max_length, truncation_mode, chat_template),
            token_budget=token_budget, rows_per_shard=rows_per_shard, dtype=dtype, device=device,
            attn_implementation=attn_implementation, batching=batching, overwrite=not resume, on_bad_row=on_bad_row,
            trust_remote_code=trust_remote_code, progress=not no_progress,
        )
        s = run_precompute(cfg, log=lambda m: click.echo(m, err=True))
        if "rank" in s:  # torchrun: rank 0 prints the summary
            return
        skipped = ", ".join(f"{k}: {v}" for k, v in s["skipped_by_reason"].items()) or "none"
        click.echo(
            f"wrote {s['rows']} pairs ({s['rows_scored']} scored now) in {s['shards']} shards to {s['out']}\n"
            f"  skipped rows: {s['skipped']} ({skipped}); identical chosen/rejected: {s['identical_pairs']}\n"
            f"  tokens: {s['tokens']:,}  batching: {s['mode']}  padding: {s['padding_fraction']:.1%}  wall: {s['wall_s']:.1f} s  "
            f"throughput: {s['tokens_per_s']:,.0f} tokens/s\n"
            f"  cache size: {s['bytes'] / 2**20:.2f} MiB ({s['bytes_per_completion_token']:.1f} bytes per "
            f"completion token)"
        )

    run_cli(body, debug)


if __name__ == "__main__":
    main()
