"""Issue 22, items 4, 6, 12, 15 and 16: train-dpo's output dir, checkpoints and resume, end to end.

4: a resume names a checkpoint of this --output-dir (no other folder is written into with another run's files);
6: each run has a run id (the output dir's run record, every checkpoint's record, the run manifest), a resume needs
   it, and --overwrite-output-dir retires the replaced run's own files and nothing else;
12: a checkpoint file that could run code when loaded (a pickle) is refused by name before anything is verified;
15: a full disk during a save is one refusal naming the file and the device, and the half-saved checkpoint is never
    resumed;
16: Ctrl-C prints the command that resumes (or, with nothing saved, the one that starts again), and that command
    works; precompute-ref's advice (the same command resumes) stays.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from faultkit import TRAIN, assert_one_paragraph, copy_tree, file_hashes, precompute, train
from schemas import run_manifest as rm

ENFORCE_FAIL = ("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0: file "
                "write failed")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, llama_dir, dpo_data, dpo_cache):
    """A 2-step run saving checkpoint-1 and checkpoint-2."""
    base = tmp_path_factory.mktemp("edges-resume")
    args = ["--model", llama_dir, "--data", dpo_data, "--ref-cache", dpo_cache, *TRAIN[:TRAIN.index("--max-steps")],
            *TRAIN[TRAIN.index("--max-steps") + 2:], "--max-steps", "2", "--save-steps", "1", "--seed", "7"]
    run = train(*args, "--output-dir", base / "run")
    assert run.exit_code == 0, run.output
    return {"base": base, "args": args, "run": base / "run"}


def run_id(out):
    return json.loads((out / rm.RUN_RECORD).read_text())["run_id"]


def record_run_id(checkpoint):
    return json.loads((checkpoint / rm.CHECKPOINT_RECORD).read_text()).get("run_id")


def refused(result, *parts):
    assert result.exit_code == 2, result.output
    assert_one_paragraph(result.output)
    for part in parts:
        assert part in result.output, result.output
    return result.output


# ---------------------------------------------------------------------------------------------------------------
# 4: a resume names a checkpoint of this output dir


def test_4_resume_from_another_runs_checkpoint_leaves_the_folder_untouched(trained, tmp_path):
    folder = tmp_path / "my-folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "metrics.jsonl").write_text("my own log\n")
    before = file_hashes(folder)
    result = train(*trained["args"], "--output-dir", folder, "--resume-from-checkpoint",
                   trained["run"] / "checkpoint-1")
    refused(result, f"error: --resume-from-checkpoint {trained['run'] / 'checkpoint-1'}: not a checkpoint of "
                    f"--output-dir {folder}", f"--output-dir {trained['run']}", "copy that whole output dir")
    assert file_hashes(folder) == before and sorted(p.name for p in folder.iterdir()) == ["metrics.jsonl", "notes.txt"]


@pytest.mark.parametrize("how", ["explicit", "true"])
def test_4_a_symlink_in_the_output_dir_to_another_runs_checkpoint_is_refused(trained, tmp_path, how):
    """Neighbour: the checkpoint named through a checkpoint-N symlink inside --output-dir (given, or picked by
    `true` as the latest)."""
    out = copy_tree(trained["run"], tmp_path / "run")
    other = copy_tree(trained["run"] / "checkpoint-2", tmp_path / "elsewhere" / "checkpoint-2")
    (out / "checkpoint-9").symlink_to(other, target_is_directory=True)
    before = file_hashes(other)
    value = out / "checkpoint-9" if how == "explicit" else "true"
    result = train(*trained["args"], "--output-dir", out, "--resume-from-checkpoint", value)
    refused(result, "not a checkpoint of --output-dir", "not a symlink")
    assert file_hashes(other) == before


# ---------------------------------------------------------------------------------------------------------------
# 6: run id; --overwrite-output-dir retires the replaced run


def test_6_the_run_id_is_in_the_run_record_every_checkpoint_and_the_run_manifest(trained):
    run = trained["run"]
    rid = run_id(run)
    assert len(rid) == 32
    assert record_run_id(run / "checkpoint-1") == record_run_id(run / "checkpoint-2") == rid
    assert json.loads((run / rm.RUN_MANIFEST).read_text())["run_id"] == rid


def test_6_overwrite_then_resume_true_never_resumes_the_replaced_run(trained, tmp_path, monkeypatch):
    """The replacing run is interrupted before its first checkpoint: the replaced run's checkpoints are gone, so
    `true` finds none (before: it resumed the old run's checkpoint-2 under the new run's manifest)."""
    out = copy_tree(trained["run"], tmp_path / "run")
    (out / "notes.txt").write_text("mine")
    old = run_id(out)
    from dpo.trainer import DPOTrainer

    def interrupt(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(DPOTrainer, "training_step", interrupt)
    stopped = train(*trained["args"], "--output-dir", out, "--overwrite-output-dir")
    assert stopped.exit_code == 130, stopped.output
    monkeypatch.undo()
    assert not list(out.glob("checkpoint-*")) and not (out / rm.RUN_MANIFEST).exists()
    assert run_id(out) != old and (out / "notes.txt").read_text() == "mine"  # not ours: left
    result = train(*trained["args"], "--output-dir", out, "--resume-from-checkpoint", "true")
    refused(result, "--resume-from-checkpoint true: no checkpoint-N folder")


def test_6_a_checkpoint_of_the_replaced_run_put_back_is_refused(trained, tmp_path):
    """Neighbour: the replaced run's checkpoint copied back after the overwrite (given by path, and picked by
    `true`): its run id is not this run's."""
    out = copy_tree(trained["run"], tmp_path / "run")
    backup = copy_tree(out / "checkpoint-2", tmp_path / "backup-checkpoint-2")
    again = train(*trained["args"], "--output-dir", out, "--overwrite-output-dir", "--max-steps", "1")
    assert again.exit_code == 0, again.output
    assert "removed the earlier run's" in again.output
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert record_run_id(out / "checkpoint-1") == run_id(out) != record_run_id(backup)
    shutil.copytree(backup, out / "checkpoint-2")
    for value in (out / "checkpoint-2", "true"):
        result = train(*trained["args"], "--output-dir", out, "--resume-from-checkpoint", value)
        refused(result, "the checkpoint belongs to another run", f"--resume-from-checkpoint {out / 'checkpoint-1'}")


@pytest.mark.parametrize("thing", ["foreign_checkpoint", "symlinked_metrics", "both_options"])
def test_6_overwrite_refuses_what_it_cannot_prove_it_owns(trained, tmp_path, thing):
    """Neighbours: a checkpoint-N folder without our record, a metrics.jsonl that is a symlink to a user's file,
    and --overwrite-output-dir together with --resume-from-checkpoint: refused before anything is deleted."""
    out = copy_tree(trained["run"], tmp_path / "run")
    users = tmp_path / "users.txt"
    users.write_text("precious")
    extra = []
    if thing == "foreign_checkpoint":
        (out / "checkpoint-7").mkdir()
        (out / "checkpoint-7" / "weights.txt").write_text("someone else's")
        expected = ("--overwrite-output-dir", "checkpoint-7 is not an earlier train-dpo run's own")
    elif thing == "symlinked_metrics":
        (out / "metrics.jsonl").unlink()
        (out / "metrics.jsonl").symlink_to(users)
        expected = ("metrics.jsonl (a symlink) is not an earlier train-dpo run's own",)
    else:
        extra = ["--resume-from-checkpoint", "true"]
        expected = ("--overwrite-output-dir starts a new run", "give one of them")
    before = file_hashes(out), {p.name for p in out.iterdir()}
    result = train(*trained["args"], "--output-dir", out, "--overwrite-output-dir", *extra)
    refused(result, *expected)
    assert (file_hashes(out), {p.name for p in out.iterdir()}) == before and users.read_text() == "precious"


# ---------------------------------------------------------------------------------------------------------------
# 12: nothing in a checkpoint runs code when it is loaded


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("name", ["rng_state.pth", "optimizer.pt", "scheduler.pt", "pytorch_model.bin", "truncated"])
def test_12_a_checkpoint_file_that_is_not_safe_to_load_is_refused_by_name(trained, tmp_path, name):
    """rng_state.pth (the issue's case) and its neighbours: the other Trainer state files holding a code-running
    pickle, weights as a pickle instead of safetensors, and a truncated optimizer.pt."""
    out = copy_tree(trained["run"], tmp_path / "run")
    ckpt = out / "checkpoint-1"
    marker = tmp_path / "code-ran"
    if name == "pytorch_model.bin":
        torch.save(load_file(ckpt / "model.safetensors"), ckpt / name)  # plain tensors: weights_only would load it
        (ckpt / "model.safetensors").unlink()
        expected = [f"{ckpt / name} is a pickle, which can run code when it is loaded"]
    elif name == "truncated":
        data = (ckpt / "optimizer.pt").read_bytes()
        (ckpt / "optimizer.pt").write_bytes(data[:len(data) // 2])
        expected = [f"{ckpt / 'optimizer.pt'} cannot be loaded safely", "not completely saved"]
    else:
        state = {"payload": RunsCode(marker)}
        torch.save(state, ckpt / name)
        expected = [f"{ckpt / name} cannot be loaded safely", "pickled objects other than tensors"]
    before = file_hashes(out)
    result = train(*trained["args"], "--output-dir", out, "--resume-from-checkpoint", ckpt)
    output = refused(result, f"error: --resume-from-checkpoint {ckpt}:", *expected)
    assert "weights_only=False" not in output and "UnpicklingError" not in output and "unexpected" not in output
    assert not marker.exists() and file_hashes(out) == before


def test_12_pickle_weights_beside_the_safetensors_are_refused(trained, tmp_path):
    """Neighbour: a pickle-only weights file (pytorch_model.bin) in a checkpoint, even next to the safetensors."""
    out = copy_tree(trained["run"], tmp_path / "run")
    ckpt = out / "checkpoint-2"
    torch.save({"payload": RunsCode(tmp_path / "code-ran")}, ckpt / "pytorch_model.bin")
    result = train(*trained["args"], "--output-dir", out, "--resume-from-checkpoint", "true")
    refused(result, f"{ckpt / 'pytorch_model.bin'} is a pickle, which can run code when it is loaded",
            "Save the weights as safetensors")
    assert not (tmp_path / "code-ran").exists()


# ---------------------------------------------------------------------------------------------------------------
# 15: a full disk while saving


def _resume_line(output: str) -> list[str]:
    lines = [line.strip() for line in output.splitlines() if line.strip().startswith("train-dpo ")]
    assert lines, output
    return shlex.split(lines[-1])[1:]


@pytest.mark.parametrize("how", ["torch_enforce_fail", "oserror_enospc"])
def test_15_disk_full_in_a_checkpoint_save_names_the_file_and_is_never_resumed(trained, tmp_path, monkeypatch, how):
    """torch.save of checkpoint-2's optimizer.pt fails as on a full disk (torch's enforce-fail text, or
    OSError(ENOSPC) from the trainer_state.json write: the neighbour, leaving half a trainer_state.json)."""
    out = tmp_path / "run"
    if how == "torch_enforce_fail":
        real_save = torch.save

        def save(obj, f, *a, **k):
            if str(f).endswith(os.path.join("checkpoint-2", "optimizer.pt")):
                with open(f, "wb") as fh:
                    fh.write(b"PK\x03\x04 half")
                raise RuntimeError(ENFORCE_FAIL)
            return real_save(obj, f, *a, **k)

        monkeypatch.setattr(torch, "save", save)
        full_device(monkeypatch, out)  # no errno: a full disk by the free space left there (storage/disk.py)
        half = out / "checkpoint-2" / "optimizer.pt"
    else:
        from transformers.trainer_callback import TrainerState

        real = TrainerState.save_to_json

        def save_to_json(self, path):
            if "checkpoint-2" not in path:
                return real(self, path)
            with open(path, "w") as fh:
                fh.write('{"global_step": 2, "log_hist')
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

        monkeypatch.setattr(TrainerState, "save_to_json", save_to_json)
        half = out / "checkpoint-2" / "trainer_state.json"
    failed = train(*trained["args"], "--output-dir", out)
    monkeypatch.undo()
    output = refused(failed, "error: no space left on device ", f"while writing {half}",
                     "checkpoint-2 is incomplete", "will not be resumed", "mounted at", "then: checkpoint-1 is the "
                     "latest complete checkpoint")
    assert "enforce fail" not in output.splitlines()[0] and "unexpected" not in output
    result = train(*trained["args"], "--output-dir", out, "--resume-from-checkpoint", "true")
    what = "no trainer_state.json in it" if how == "torch_enforce_fail" else "its trainer_state.json is not whole"
    refused(result, f"--resume-from-checkpoint true ({out / 'checkpoint-2'}): {what}",
            f"--resume-from-checkpoint {out / 'checkpoint-1'}")
    resumed = train(*_resume_line(output))  # the command the refusal printed
    assert resumed.exit_code == 0, resumed.output
    assert "trained 2 steps" in resumed.output
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2  # now whole


def full_device(monkeypatch, folder, free=0):
    """The device holding `folder` reports `free` bytes left (of 100 GiB); every other path its real figures."""
    import storage.disk

    real = shutil.disk_usage

    def disk_usage(path):
        if os.path.abspath(path).startswith(os.path.abspath(folder)):
            return type(real(path))(100 * 2**30, 100 * 2**30 - free, free)
        return real(path)

    monkeypatch.setattr(storage.disk.shutil, "disk_usage", disk_usage)


def test_15_the_torch_error_with_space_left_is_a_crash_not_a_full_disk(trained, tmp_path, monkeypatch):
    """The reverse of the torch case: the same RuntimeError (no errno) while the device has plenty free is the
    generic crash (exit 1), never "no space left"."""
    real_save = torch.save

    def save(obj, f, *a, **k):
        if str(f).endswith(os.path.join("checkpoint-2", "optimizer.pt")):
            raise RuntimeError(ENFORCE_FAIL)
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    full_device(monkeypatch, tmp_path, free=50 * 2**30)
    failed = train(*trained["args"], "--output-dir", tmp_path / "run")
    monkeypatch.undo()
    assert failed.exit_code == 1, failed.output
    assert "no space left" not in failed.output and "unexpected RuntimeError" in failed.output


def test_15_disk_full_anywhere_else_is_the_same_refusal(tmp_path, monkeypatch):
    """Neighbour: a save no command wrapped (any command, through the shared frame): ENOSPC or EDQUOT with or
    without a file name, and torch's error without an errno where the command writes to a full device."""
    import click
    from click.testing import CliRunner

    from runtime.cli import run_cli

    full_device(monkeypatch, tmp_path)
    for error in (OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.parquet")),
                  OSError(errno.EDQUOT, "Disk quota exceeded"), RuntimeError(ENFORCE_FAIL)):
        @click.command()
        def cmd(error=error):
            def body():
                raise error

            run_cli(body, False, writes_to=lambda: tmp_path)

        result = CliRunner().invoke(cmd, [])
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error: no space left on device "), result.output
        assert "then: re-run the same command to resume" in result.output


# ---------------------------------------------------------------------------------------------------------------
# 16: Ctrl-C says how to carry on


def _interrupt_at(monkeypatch, step):
    from dpo.trainer import DPOTrainer

    real = DPOTrainer.training_step

    def training_step(self, *a, **k):
        if self.state.global_step == step:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(DPOTrainer, "training_step", training_step)


def test_16_ctrl_c_prints_the_command_that_resumes_and_it_does(trained, tmp_path, monkeypatch):
    out = tmp_path / "run"
    _interrupt_at(monkeypatch, 1)  # after checkpoint-1, inside step 2
    stopped = train(*trained["args"], "--output-dir", out)
    monkeypatch.undo()
    assert stopped.exit_code == 130, stopped.output
    assert "interrupted; checkpoint-1 is the latest complete checkpoint; resume from it with" in stopped.output
    assert "re-run the same command" not in stopped.output
    command = _resume_line(stopped.output)
    assert command[-2:] == ["--resume-from-checkpoint", str(out / "checkpoint-1")]
    resumed = train(*command)
    assert resumed.exit_code == 0, resumed.output
    assert "trained 2 steps" in resumed.output


def test_16_sigterm_ends_the_run_as_ctrl_c_does_with_its_own_exit_code(trained, tmp_path, monkeypatch):
    """A scheduler's preemption (SIGTERM, delivered to the process inside step 2): exit 143, the checkpoint kept and
    the command that resumes printed, as after Ctrl-C; the signal's handler is put back after the command."""
    import signal

    from dpo.trainer import DPOTrainer

    out, real = tmp_path / "run", DPOTrainer.training_step

    def training_step(self, *a, **k):
        if self.state.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *a, **k)

    monkeypatch.setattr(DPOTrainer, "training_step", training_step)
    stopped = train(*trained["args"], "--output-dir", out)
    monkeypatch.undo()
    assert stopped.exit_code == 143, stopped.output
    assert "terminated (SIGTERM); checkpoint-1 is the latest complete checkpoint; resume from it with" in stopped.output
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    resumed = train(*_resume_line(stopped.output))
    assert resumed.exit_code == 0 and "trained 2 steps" in resumed.output, resumed.output


def test_16_ctrl_c_before_the_first_checkpoint_says_nothing_was_saved(trained, tmp_path, monkeypatch):
    """Neighbour: interrupted in step 1 of a run that replaced another (--overwrite-output-dir): nothing to resume;
    the printed command starts again, and works."""
    out = copy_tree(trained["run"], tmp_path / "run")
    _interrupt_at(monkeypatch, 0)
    stopped = train(*trained["args"], "--output-dir", out, "--overwrite-output-dir")
    monkeypatch.undo()
    assert stopped.exit_code == 130, stopped.output
    assert "interrupted; no checkpoint was saved yet, so there is nothing to resume" in stopped.output
    command = _resume_line(stopped.output)
    assert "--overwrite-output-dir" in command and "--resume-from-checkpoint" not in command
    again = train(*command)
    assert again.exit_code == 0, again.output
    assert record_run_id(out / "checkpoint-2") == run_id(out)


def test_16_precompute_ctrl_c_prints_the_command_that_resumes_and_it_does(llama_dir, dpo_data, tmp_path, monkeypatch):
    """Neighbour: the other command through the same frame. Interrupted after its first shard, precompute-ref prints
    the command that resumes: its own options (a boolean given as a word read as the flag), without --overwrite
    (which would delete the shards it kept); run as printed, it scores only the rest."""
    from schemas import format as fmt

    real, written = fmt.write_shard, []

    def write_shard(*a, **k):
        if written:
            raise KeyboardInterrupt
        written.append(real(*a, **k))
        return written[-1]

    monkeypatch.setattr(fmt, "write_shard", write_shard)
    out = tmp_path / "cache"
    args = ["--model", llama_dir, "--data", dpo_data, "--out", out, "--rows-per-shard", 4, "--top-k", 3]
    stopped = precompute(*args, "--overwrite", "--progress", "false")
    monkeypatch.undo()
    assert stopped.exit_code == 130, stopped.output
    assert "interrupted; the finished shards are kept; resume with the same command:" in stopped.output
    line = [w.strip() for w in stopped.output.splitlines() if w.strip().startswith("precompute-ref ")]
    command = shlex.split(line[-1])[1:]
    assert "--overwrite" not in command and "--no-progress" in command and command[command.index("--top-k") + 1] == "3"
    resumed = precompute(*command)
    assert resumed.exit_code == 0, resumed.output
    assert "(4 scored now)" not in resumed.output and "1 already done" in resumed.output, resumed.output


def test_15_precompute_disk_full_names_its_cache_folder(llama_dir, dpo_data, tmp_path, monkeypatch):
    """Neighbour: the other command: a shard write that finds the disk full (pyarrow's OSError text, no file name) is
    told as the same refusal, naming the file under --out being written; the same command then resumes."""
    import pyarrow.parquet as pq

    real = pq.write_table

    def full(table, where, *a, **k):
        where.write(b"PAR1 half")
        raise OSError("[Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(pq, "write_table", full)
    out = tmp_path / "cache"
    failed = precompute("--model", llama_dir, "--data", dpo_data, "--out", out)
    monkeypatch.setattr(pq, "write_table", real)
    output = refused(failed, "error: no space left on device ", f"while writing {out}",
                     "then: the finished shards are kept; resume with the same command:")
    assert "unexpected" not in output
    again = precompute("--model", llama_dir, "--data", dpo_data, "--out", out)
    assert again.exit_code == 0, again.output


def test_16_the_printed_command_overrides_what_a_config_file_says(tmp_path):
    """Neighbour (another option): --overwrite-output-dir and --resume-from-checkpoint set in a --config file are
    overridden on the printed command line, so that it does what it says."""
    from dpo.cli import next_step, resolve_config

    out = tmp_path / "run"
    ckpt = out / "checkpoint-3"
    ckpt.mkdir(parents=True)
    rm.write_json(out / rm.RUN_RECORD, rm.run_record("d" * 32, "2026-01-01T00:00:00+00:00"))
    config = tmp_path / "run.yaml"
    config.write_text(f"model: m\ndata: d.jsonl\noutput_dir: {out}\noverwrite_output_dir: true\n")
    given = {"learning_rate": 0.5, "report_to": None}
    cfg = resolve_config(str(config), given)
    assert next_step(cfg, str(config), given) == "nothing was saved to --output-dir yet; re-run the same command"
    cfg.run_id = "d" * 32
    text = next_step(cfg, str(config), given)
    assert "nothing to resume" in text
    assert shlex.split(text.splitlines()[-1]) == ["train-dpo", "--config", str(config), "--learning-rate", "0.5",
                                                  "--overwrite-output-dir"]
    (ckpt / "trainer_state.json").write_text('{"global_step": 3}')
    (ckpt / rm.CHECKPOINT_RECORD).write_text(json.dumps({"run_id": "d" * 32}))
    text = next_step(cfg, str(config), given)
    assert text.startswith("checkpoint-3 is the latest complete checkpoint")
    assert shlex.split(text.splitlines()[-1])[3:] == ["--learning-rate", "0.5", "--resume-from-checkpoint", str(ckpt),
                                                      "--no-overwrite-output-dir"]


@pytest.mark.parametrize("other", [("--beta", "0.2"), ("--loss-type", "ipo"), ("--label-smoothing", "0.1")])
def test_17_a_resume_with_other_loss_options_is_refused_naming_them(trained, tmp_path, other):
    """Found by the closing UX pass: a resume with another --beta went on, and the run's card and run-manifest.json
    then said the new β for the whole run. Each checkpoint records its loss and the options that loss reads; a
    resume with other values is refused naming them by owner, with the checkpoint's values to resume with, and
    nothing written; with its own values it resumes."""
    out = copy_tree(trained["run"], tmp_path / "run")
    before = file_hashes(out)
    result = train(*trained["args"], "--output-dir", out, "--max-steps", "3", "--resume-from-checkpoint", "true",
                   *other)
    option, value = other
    refused(result, "the checkpoint was trained with other loss options", f"this run:       {option} {value}",
            f"the checkpoint: {option} " + ("sigmoid" if option == "--loss-type" else ""),
            "(the checkpoint's), or train with these options as a new run into a fresh --output-dir")
    assert file_hashes(out) == before
    again = train(*trained["args"], "--output-dir", out, "--max-steps", "3", "--resume-from-checkpoint", "true")
    assert again.exit_code == 0, again.output


def test_18_a_run_cut_in_its_final_save_is_not_resumed_past_its_steps(trained, tmp_path, monkeypatch):
    """Hostile pass (h44): SIGTERM in the final save left checkpoint-2 (step 2 of --max-steps 2); the printed resume
    from it trained a step 3. The way on now says the checkpoint holds the last step, and a resume from a checkpoint
    at --max-steps is refused (nothing left to train), nothing written; with a higher --max-steps it trains on."""
    from dpo.trainer import DPOTrainer

    out = tmp_path / "run"

    real = DPOTrainer.save_model

    def cut(self, output_dir=None, *a, **k):  # the final save into --output-dir (a checkpoint's goes on)
        if output_dir is not None and Path(output_dir) == out:
            raise KeyboardInterrupt
        return real(self, output_dir, *a, **k)

    monkeypatch.setattr(DPOTrainer, "save_model", cut)
    stopped = train(*trained["args"], "--output-dir", out)
    monkeypatch.undo()
    assert stopped.exit_code == 130, stopped.output
    said = " ".join(stopped.output.split())
    assert "checkpoint-2 holds the run's last step (2 of --max-steps 2); only the final save was interrupted" in said
    before = file_hashes(out)
    refused(train(*trained["args"], "--output-dir", out, "--resume-from-checkpoint", "true"),
            "the checkpoint is at step 2 of --max-steps 2, so nothing is left to train")
    assert file_hashes(out) == before
    more = train(*trained["args"], "--output-dir", out, "--max-steps", "3", "--resume-from-checkpoint", "true")
    assert more.exit_code == 0 and "trained 3 steps" in more.output, more.output
