"""Command line of precompute-ref."""

from __future__ import annotations

import os

import click

from precompute.config import PrecomputeConfig, checked_inputs
from runtime.cli import (GroupedCommand, command_text, exit_without_teardown, given_values, quiet_libraries, run_cli,
                         shell_word, typed_options)
from runtime.options import (ENCODING_OPTIONS, TRL_ALIASES, TRL_NEGATIONS, dataclass_options, encoding_from,
                             encoding_options)
from runtime.config_file import options_from_file
from runtime.locations import Location, record_sources
from runtime.terminal import counted, echo


def summary_text(s: dict) -> str:
    """The closing lines: what the cache holds, and the work done now (a rerun with every pair already in the cache
    did none: it says so rather than a throughput of 0)."""
    skipped = ", ".join(f"{k}: {v}" for k, v in s["skipped_by_reason"].items()) or "none"
    if s["rows_scored"]:
        work = (f"  tokens: {s['tokens']:,}  batching: {s['mode']}  padding: {s['padding_fraction']:.1%}  "
                f"wall: {s['wall_s']:.1f} s  throughput: {s['tokens_per_s']:,.0f} tokens/s")
    else:
        work = (f"  nothing to score: every pair was in the cache already (batching {s['mode']}); "
                f"wall: {s['wall_s']:.1f} s")
    ranks = s.get("rank_wall_s") or []
    if s["rows_scored"] and len(ranks) > 1:  # torchrun: how far apart the ranks (tensor-parallel groups) finished
        spread = max(ranks) - min(ranks)
        unit = "tensor-parallel group" if s.get("tp_size", 1) > 1 else "rank"
        work += (f"\n  {unit}s: {len(ranks)}, scoring wall per {unit} {min(ranks):.1f}-{max(ranks):.1f} s "
                 f"(spread {spread:.1f} s, {spread / max(ranks) if max(ranks) else 0:.0%} of the slowest)")
    per_token = s["bytes_per_completion_token"]
    u = s.get("update")
    if u and not (u["added"] or u["removed"] or u["replaced"]):  # a no-op update writes no version
        version = f"  update: nothing to change; the cache stays at version {u['version'] - 1}\n"
    else:
        version = (f"  update: version {u['version']}: {counted(u['added'], 'row')} added, {u['removed']} removed, "
                   f"{u['replaced']} replaced; {counted(u['kept_shards'], 'shard')} kept, {u['copied_shards']} copied "
                   "without removed rows\n" if u else "")
    changed = s["rows_scored"] or (u and (u["added"] or u["removed"] or u["replaced"]))
    made = (f"wrote {counted(s['rows'], 'pair')} ({s['rows_scored']} scored now) in {counted(s['shards'], 'shard')} to "
            if changed else  # a rerun or an update with nothing left to do
            f"nothing to score: the cache holds {counted(s['rows'], 'pair')} ({s['rows_scored']} scored now) in "
            f"{counted(s['shards'], 'shard')} at ")
    return (
        f"{made}{shell_word(s['out'])}\n{version}"
        f"  skipped rows: {s['skipped']} ({skipped}); identical chosen/rejected: {s['identical_pairs']}\n{work}\n"
        f"  cache size: {s['bytes'] / 2**20:.2f} MiB"
        + (f" ({per_token:.1f} bytes per completion token)" if per_token is not None else "")
        + (f"\n  top-{s['top_k']}: every completion token's {s['top_k']} most probable tokens (ids, log-probs) and "
           "the mass outside them, for train-dpo's KL figures" if s.get("top_k") else "")
    )


@click.command(cls=GroupedCommand, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
               elsewhere={"--output-dir": "precompute-ref writes its cache to --out DIR (--output-dir is train-dpo's, "
                                          "for the trained model)"})
@click.option("--config", "config_file", type=Location("input", local=click.Path(exists=True, dir_okay=False)),
              help="YAML or JSON file of these options (snake_case or kebab-case keys, or TRL's spellings such as "
                   "model_name_or_path); the command line overrides it.")
@dataclass_options(PrecomputeConfig, enforce_required=False, aliases=TRL_ALIASES, negations=TRL_NEGATIONS)
@encoding_options
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def main(config_file, debug, **options):
    """Run the frozen reference model once over preference pairs and write per-token log-probs to a stamped,
    resumable Parquet cache for train-dpo."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def body():
        # the file's values, then the command line's over them; both read by each option's own type
        from_file = options_from_file(config_file, main, "precompute-ref", TRL_ALIASES) if config_file else {}
        given = from_file | given_values(options)
        missing = [f"--{k}" for k in ("model", "data") if not given.get(k)]
        if missing:
            raise click.UsageError(f"missing {', '.join(missing)} (on the command line or in --config)")
        encoding = {k: given.pop(k, None) for k in ENCODING_OPTIONS}
        cfg = PrecomputeConfig(**given, encoding=encoding_from(**encoding),
                               given=frozenset(given) | {k for k, v in encoding.items() if v is not None},
                               config_file=config_file)
        record_sources(cfg, config_file, set(from_file) - set(given_values(options)), getattr(from_file, "written", {}),
                       typed_options())
        checked_inputs(cfg)  # a command line refused by its options alone imports no model library
        from .job import run_precompute

        quiet_libraries()
        s = run_precompute(cfg, log=lambda m: echo(m, err=True))
        if "rank" in s:  # torchrun: rank 0 prints the summary
            return
        echo(summary_text(s))

    run_cli(body, debug, writes_to=lambda: options.get("out"), next_step=lambda: resume_step(options, config_file))


def resume_step(options: dict, config_file=None) -> str:
    """After Ctrl-C (or a full disk): the command that resumes the job (the same one; its finished shards are kept,
    and a resume takes the settings they were scored with), never with --overwrite."""
    again = {k: v for k, v in given_values(options).items() if k != "overwrite"}
    if config_file and "overwrite" in options_from_file(config_file, main, "precompute-ref", TRL_ALIASES):
        again["overwrite"] = False  # the file's overwrite: true, overridden on the command line
    return ("the finished shards are kept; resume with the same command:\n  "
            + command_text("precompute-ref", again, ("--config", config_file) if config_file else ()))


def process_main():
    """The console script and `python -m precompute.cli`: the command as the whole process, without the interpreter's
    teardown at exit (runtime.cli.exit_without_teardown)."""
    exit_without_teardown(main)


if __name__ == "__main__":
    process_main()
