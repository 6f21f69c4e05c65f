"""What each command imports before it answers `--help` or refuses a command line (issue 25 item 11, issue 26 item 4):
read from `python -X importtime` in a child process, so the test says which modules were imported, never how long
it took. train-dpo's TrainingArguments options come from a table stored per installation (dpo/trainer_options.py);
the options and the whole --help built from it are compared with those computed from TrainingArguments itself.
Cross-cutting (all three commands), so top level."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "datasets", "peft")


def run_cli(module: str, args: list[str], home: Path, cwd: Path) -> tuple[subprocess.CompletedProcess, set[str]]:
    """`python -X importtime -m MODULE ARGS` with REFCACHE_HOME=home: the process and the modules it imported."""
    env = {**os.environ, "REFCACHE_HOME": str(home),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", module, *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)
    modules = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    return proc, modules


def heavy(modules: set[str], names=HEAVY) -> list[str]:
    return sorted(n for n in names if n in modules)


def test_train_dpo_help_and_refusals_do_not_import_torch(tmp_path):
    home = tmp_path / "home"
    first, _ = run_cli("dpo.cli", ["--help"], home, tmp_path)  # no table yet: computed from TrainingArguments, stored
    assert first.returncode == 0, first.stderr[-2000:]
    assert len(list(home.glob("train-dpo-options-*.json"))) == 1
    again, modules = run_cli("dpo.cli", ["--help"], home, tmp_path)
    assert again.returncode == 0 and again.stdout == first.stdout
    assert "--per-device-train-batch-size" in again.stdout and "--lr-scheduler-kwargs" in again.stdout
    assert heavy(modules) == []
    bad, modules = run_cli("dpo.cli", ["--model", "m", "--no-such-option", "1"], home, tmp_path)
    assert bad.returncode == 2 and "No such option '--no-such-option'" in bad.stderr
    assert heavy(modules) == []
    missing, modules = run_cli("dpo.cli", ["--config", str(tmp_path / "missing.yaml")], home, tmp_path)
    assert missing.returncode == 2 and "missing.yaml" in missing.stderr and "does not exist" in missing.stderr
    assert heavy(modules) == []
    wrong_kind, modules = run_cli("dpo.cli", ["--model", "m", "--log-level", "bogus"], home, tmp_path)
    assert wrong_kind.returncode == 2 and "bogus" in wrong_kind.stderr  # a TrainingArguments choice, from the table
    assert heavy(modules) == []
    incomplete, modules = run_cli("dpo.cli", ["--model", "m"], home, tmp_path)
    assert incomplete.returncode == 2 and "missing --data, --output-dir" in incomplete.stderr
    assert heavy(modules) == []


def test_audit_ref_help_refusals_and_a_failing_cache_import_no_torch(tmp_path, dpo_cache):
    home = tmp_path / "home"
    helped, modules = run_cli("audit.cli", ["--help"], home, tmp_path)
    assert helped.returncode == 0 and "--sample" in helped.stdout
    assert heavy(modules, HEAVY + ("polars", "pyarrow")) == []
    missing, modules = run_cli("audit.cli", [str(tmp_path / "no-cache")], home, tmp_path)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert heavy(modules, HEAVY + ("polars", "pyarrow")) == []
    damaged = tmp_path / "cache"
    shutil.copytree(dpo_cache, damaged)
    shard = sorted(damaged.glob("shard-*.parquet"))[0]
    shard.write_bytes(shard.read_bytes() + b"\0")  # its size and sha256 no longer match the manifest
    failed, modules = run_cli("audit.cli", [str(damaged)], home, tmp_path)
    assert failed.returncode == 1 and "shard_files" in failed.stdout
    assert heavy(modules) == []  # the cache's own checks need no model library


def test_precompute_ref_help_and_refusals_import_no_model_library(tmp_path):
    """--help lists every batching mode of the registry (the modes import torch only where they score), and what
    click and the options alone refuse (precompute.config.checked_inputs) is refused before precompute.job is
    imported: no torch, transformers or datasets."""
    from precompute.modes import REGISTRY

    home = tmp_path / "home"
    helped, modules = run_cli("precompute.cli", ["--help"], home, tmp_path)
    assert helped.returncode == 0, helped.stderr[-2000:]
    unwrapped = lambda text: "".join(text.split())  # click wraps lines at spaces and hyphens
    assert unwrapped(f"[{'|'.join(('auto', *REGISTRY))}]") in unwrapped(helped.stdout)
    for name, mode in REGISTRY.items():
        assert unwrapped(f"{name}: {mode.description}.") in unwrapped(helped.stdout), name
    assert heavy(modules, HEAVY + ("polars", "pyarrow")) == [] and "precompute.job" not in modules
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    refusals = [  # (arguments, what stderr says)
        (["--data", data], "missing --model (on the command line or in --config)"),
        (["--model", "m", "--data", data, "--batching", "bogus"], "'bogus' is not one of 'auto', 'full_forward'"),
        (["--model", "m", "--data", data, "--token-budget", "0"], "--token-budget"),
        (["--model", "m", "--data", data, "--out", data / "cache"], f"--out {data / 'cache'} is inside --data {data}"),
        (["--model", "m", "--data", data, "--update", "--overwrite"], "--update keeps the cache's rows"),
    ]
    for args, says in refusals:
        refused, modules = run_cli("precompute.cli", [str(a) for a in args], home, tmp_path)
        assert refused.returncode == 2 and says in refused.stderr, (args, refused.stderr[-2000:])
        assert heavy(modules) == [] and "precompute.job" not in modules, args
    assert not (data / "cache").exists() and [p.name for p in data.iterdir()] == ["train.jsonl"]


def test_stored_trainer_options_are_the_computed_ones(tmp_path, monkeypatch):
    """The table read back is the one computed from TrainingArguments; train-dpo's options from it are, option for
    option and in its whole --help, those that TrainingArguments itself gives (none lost, none added)."""
    import transformers

    from dpo import trainer_options
    from dpo.cli import main
    from dpo.options import NOT_TRAINER_OPTIONS
    from runtime.cli import GroupedCommand
    from runtime.options import dataclass_options

    monkeypatch.setenv("REFCACHE_HOME", str(tmp_path))
    computed = trainer_options.computed_specs(NOT_TRAINER_OPTIONS)
    stored = trainer_options.trainer_specs(NOT_TRAINER_OPTIONS)  # computed and stored
    (path,) = tmp_path.glob("train-dpo-options-*.json")
    read = trainer_options.trainer_specs(NOT_TRAINER_OPTIONS)  # read back
    assert [s.to_json() for s in read] == [s.to_json() for s in stored] == [s.to_json() for s in computed]
    assert any(isinstance(s.kind, click.Choice) for s in read) and any(s.multiple for s in read)

    fresh = {p.name: p for p in dataclass_options(transformers.TrainingArguments, group=trainer_options.GROUP,
                                                  skip=NOT_TRAINER_OPTIONS, locations=trainer_options.LOCATIONS,
                                                  domains=trainer_options.TRAINER_DOMAINS)(
        lambda **kw: None).__click_params__}
    ours = {p.name: p for p in main.params if getattr(p, "group", None) == trainer_options.GROUP}
    expected = {f.name for f in dataclasses.fields(transformers.TrainingArguments)
                if f.init and f.name not in NOT_TRAINER_OPTIONS}
    assert set(ours) == set(fresh) == expected
    ctx = click.Context(main)
    for name, param in ours.items():
        assert param.get_help_record(ctx) == fresh[name].get_help_record(ctx), name
        assert (param.opts, param.secondary_opts, param.multiple, param.is_flag) == (
            fresh[name].opts, fresh[name].secondary_opts, fresh[name].multiple, fresh[name].is_flag), name
    rebuilt = GroupedCommand(main.name, params=[fresh.get(p.name, p) for p in main.params], help=main.help,
                             context_settings=main.context_settings)
    context = lambda command: click.Context(command, **command.context_settings)  # as the command line makes it
    assert rebuilt.get_help(context(rebuilt)) == main.get_help(context(main))

    path.write_text("{not json")  # damaged: computed again and stored again
    assert [s.to_json() for s in trainer_options.trainer_specs(NOT_TRAINER_OPTIONS)] == [
        s.to_json() for s in computed]
    assert json.loads(path.read_text())["options"] == [s.to_json() for s in computed]


def test_the_table_key_names_the_installation_and_train_dpo_s_own_options():
    from dpo import trainer_options
    from dpo.options import NOT_TRAINER_OPTIONS

    key = trainer_options.table_key(NOT_TRAINER_OPTIONS)
    assert key == trainer_options.table_key(set(NOT_TRAINER_OPTIONS))  # stable
    assert key != trainer_options.table_key(NOT_TRAINER_OPTIONS - {"learning_rate"})  # another TrainConfig


def test_an_unwritable_cache_folder_still_gives_the_options(tmp_path, monkeypatch):
    from dpo import trainer_options
    from dpo.options import NOT_TRAINER_OPTIONS

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("REFCACHE_HOME", str(blocker / "under-a-file"))
    specs = trainer_options.trainer_specs(NOT_TRAINER_OPTIONS)
    assert specs and not (blocker / "under-a-file").exists()
    if os.geteuid() != 0:  # a read-only folder (root writes anyway)
        folder = tmp_path / "ro"
        folder.mkdir(mode=0o500)
        monkeypatch.setenv("REFCACHE_HOME", str(folder))
        assert trainer_options.trainer_specs(NOT_TRAINER_OPTIONS) and not list(folder.iterdir())


def test_a_table_behind_a_link_is_not_read(tmp_path, monkeypatch):
    """The stored table is read only as a plain file of its own: a link planted at its name (to a table whose
    options say otherwise) is not followed; the options are computed from TrainingArguments instead."""
    import json

    from dpo import trainer_options
    from dpo.options import NOT_TRAINER_OPTIONS

    monkeypatch.setenv("REFCACHE_HOME", str(tmp_path / "home"))
    computed = trainer_options.computed_specs(NOT_TRAINER_OPTIONS)
    path = trainer_options.cache_folder() / f"train-dpo-options-{trainer_options.table_key(NOT_TRAINER_OPTIONS)}.json"
    path.parent.mkdir(parents=True)
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps({"format": trainer_options.FORMAT, "options": [computed[0].to_json()]}))
    path.symlink_to(forged)
    specs = trainer_options.trainer_specs(NOT_TRAINER_OPTIONS)
    assert [s.to_json() for s in specs] == [s.to_json() for s in computed] and len(specs) > 1
    assert path.is_symlink() and json.loads(forged.read_text())["options"] == [computed[0].to_json()]  # untouched


def test_audit_ref_show_of_the_cache_alone_imports_no_torch(tmp_path, dpo_cache):
    """Issue 36 item 5: `audit-ref CACHE --show ROW` (no --run, no --data) reads the cache and the tokenizer the cache
    was made with (its hash checked against the stamp): neither torch nor datasets nor peft is imported. (transformers
    is: the tokenizer's class.) A mistyped row is refused the same way."""
    home = tmp_path / "home"
    shown, modules = run_cli("audit.cli", [str(dpo_cache), "--show", "r0003"], home, tmp_path)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "row 3 id 'r0003'" in shown.stdout and "margin: reference chosen - rejected" in shown.stdout
    assert heavy(modules, ("torch", "datasets", "peft")) == []
    typo, modules = run_cli("audit.cli", [str(dpo_cache), "--show", "r003"], home, tmp_path)
    assert typo.returncode == 2 and "did you mean 'r0003'" in typo.stderr, typo.stderr[-2000:]
    assert heavy(modules, HEAVY) == []  # refused before the tokenizer loads
