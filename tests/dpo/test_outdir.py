"""dpo/outdir.py: train-dpo's --output-dir is apart from every input, never a used folder unless asked or resuming,
and nothing is created while checking; metrics.jsonl keeps exactly the records up to the step a run resumes from."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dpo.outdir import check_no_links, check_output_dir, prepare_metrics
from runtime.errors import JobError


def config(tmp_path, out, **changes):
    values = dict(output_dir=str(out), model=str(tmp_path / "model"), ref_model=None, ref_cache=str(tmp_path / "cache"),
                  eval_ref_cache=None, data=str(tmp_path / "prefs.jsonl"), eval_data=None, overwrite_output_dir=False,
                  resume_from_checkpoint=None, config_file=None, deepspeed=None, fsdp_config=None,
                  lora=SimpleNamespace(init_adapter=None))
    return SimpleNamespace(**{**values, **changes})


def test_a_new_folder_passes_and_is_not_created(tmp_path):
    check_output_dir(config(tmp_path, tmp_path / "runs" / "one"))
    assert not (tmp_path / "runs").exists()


def test_a_used_folder_is_refused_unless_overwrite_or_resume(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    check_output_dir(config(tmp_path, out))  # empty: fine
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(JobError, match=r"already holds files \(metrics.jsonl\).*--overwrite-output-dir"):
        check_output_dir(config(tmp_path, out))
    (out / "config.json").write_text("{}")  # a user's: --overwrite-output-dir would be refused, so not offered
    with pytest.raises(JobError, match=r"holds config.json, which no earlier train-dpo run there wrote, where this "
                                       r"run would write: move it elsewhere") as e:
        check_output_dir(config(tmp_path, out))
    assert "--overwrite-output-dir" not in str(e.value)
    (out / "config.json").unlink()
    check_output_dir(config(tmp_path, out, overwrite_output_dir=True))
    check_output_dir(config(tmp_path, out, resume_from_checkpoint=str(out / "checkpoint-2")))


def test_a_file_in_the_way_and_an_input_folder_are_refused(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(JobError, match=r"a-file is a file, not a directory"):
        check_output_dir(config(tmp_path, tmp_path / "a-file" / "out"))
    with pytest.raises(JobError, match=r"is inside --ref-cache"):
        check_output_dir(config(tmp_path, tmp_path / "cache" / "run", overwrite_output_dir=True))


def write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_prepare_metrics_keeps_the_records_up_to_the_resumed_step(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": 1, "loss": 0.7}, {"step": 2, "loss": 0.6}, {"step": 2, "eval_loss": 0.65},
               {"step": 3, "loss": 0.5}, {"step": 4, "eval_loss": 0.6}]
    write_metrics(metrics, records)
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    seen = prepare_metrics(metrics, str(checkpoint))
    assert seen == {(1, "train"), (2, "train"), (2, "eval")}
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == records[:3]
    assert not list(tmp_path.glob(".metrics.jsonl.tmp"))


def test_prepare_metrics_starts_a_new_run_empty(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics, [{"step": 1, "loss": 0.7}])
    assert prepare_metrics(metrics, None) == set() and not metrics.exists()


def test_the_lock_file_does_not_make_a_folder_used_unless_it_is_a_symlink(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".refcache.lock").write_text("123")  # left by a finished run (the OS dropped its lock)
    check_output_dir(config(tmp_path, out))
    (out / ".refcache.lock").unlink()
    (out / ".refcache.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(JobError, match=r"already holds files \(.refcache.lock\)"):
        check_output_dir(config(tmp_path, out))


def test_a_used_folder_holding_a_link_is_refused_even_with_overwrite(tmp_path):
    from storage.files import UnsafeDestination

    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    (out / "checkpoint-2" / "optimizer.pt").hardlink_to(victim)
    check_output_dir(config(tmp_path, out, overwrite_output_dir=True))
    with pytest.raises(UnsafeDestination, match=r"checkpoint-2/optimizer.pt is a hard link"):
        check_no_links(out)
    (out / "checkpoint-2" / "optimizer.pt").unlink()
    (out / "checkpoint-2" / "optimizer.pt").symlink_to(victim)
    with pytest.raises(UnsafeDestination, match=r"checkpoint-2/optimizer.pt is a symlink"):
        check_no_links(out)
    assert victim.read_text() == "precious"


def test_every_input_option_is_kept_apart_config_and_adapter_included(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "ds.json").write_text("{}")
    for changes, option in [({"config_file": str(out / "train.yaml")}, "--config"),
                            ({"lora": SimpleNamespace(init_adapter=str(out / "adapter"))}, "--init-adapter"),
                            ({"deepspeed": str(out / "ds.json")}, "--deepspeed")]:
        with pytest.raises(JobError, match=rf"--output-dir {out} contains {option} "):
            check_output_dir(config(tmp_path, out, overwrite_output_dir=True, **changes))


# ---------------------------------------------------------------------------------------------------------------
# dpo/resume.py: which checkpoint a run may resume; what --overwrite-output-dir retires (issue 22, items 4, 6, 12)


def fake_run(out, run_id="a" * 32, steps=(1, 2)):
    """An output dir as a train-dpo run leaves it, with tiny but real checkpoint files."""
    import torch
    from safetensors.torch import save_file

    from schemas import run_manifest as rm

    out.mkdir(parents=True, exist_ok=True)
    rm.write_json(out / rm.RUN_RECORD, rm.run_record(run_id, "2026-01-01T00:00:00+00:00"))
    for step in steps:
        ckpt = out / f"checkpoint-{step}"
        ckpt.mkdir()
        (ckpt / "refcache-reference.json").write_text(json.dumps({"cache": None, "run_id": run_id}))
        save_file({"w": torch.zeros(2)}, ckpt / "model.safetensors")
        torch.save({"state": {0: {"exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 1e-3}]}, ckpt / "optimizer.pt")
        torch.save({"python": (3, (1, 2), None), "cpu": torch.zeros(4, dtype=torch.uint8)}, ckpt / "rng_state.pth")
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    write_metrics(out / "metrics.jsonl", [{"step": 1, "loss": 0.7}])
    return out


def test_a_resume_names_a_complete_checkpoint_of_this_output_dir_and_run(tmp_path):
    from dpo.resume import check_resume

    out = fake_run(tmp_path / "run")
    check_resume(str(out / "checkpoint-2"), out)
    check_resume(str(out / ".." / "run" / "checkpoint-1"), out)  # the same folder, resolved
    other = fake_run(tmp_path / "other", run_id="b" * 32)
    with pytest.raises(JobError, match=r"not a checkpoint of --output-dir .*run.*resume with that run's --output-dir"):
        check_resume(str(other / "checkpoint-1"), out)
    (out / "checkpoint-7").symlink_to(other / "checkpoint-2", target_is_directory=True)
    with pytest.raises(JobError, match="not a symlink"):
        check_resume(str(out / "checkpoint-7"), out, latest=True)
    (out / "checkpoint-2" / "trainer_state.json").write_text('{"global_st')  # half written (disk full)
    with pytest.raises(JobError, match=r"its trainer_state.json is not whole .*latest of this run's: "
                                       r"--resume-from-checkpoint .*checkpoint-1\)"):
        check_resume(str(out / "checkpoint-2"), out)


def test_a_checkpoint_of_another_run_id_or_an_output_dir_without_a_run_record_is_refused(tmp_path):
    from dpo.resume import check_resume, resumable

    out = fake_run(tmp_path / "run")
    (out / "checkpoint-2" / "refcache-reference.json").write_text(json.dumps({"cache": None, "run_id": "c" * 32}))
    with pytest.raises(JobError, match=r"belongs to another run \(run id c+\).*--resume-from-checkpoint .*-1\)"):
        check_resume(str(out / "checkpoint-2"), out)
    assert resumable(out) == [out / "checkpoint-1"]
    (out / "refcache-run.json").unlink()
    with pytest.raises(JobError, match=r"refcache-run.json is missing.*does not say which run"):
        check_resume(str(out / "checkpoint-1"), out)
    assert resumable(out) == []


@pytest.mark.parametrize("name", ["rng_state.pth", "optimizer.pt", "scaler.pt", "rng_state_1.pth"])
def test_a_state_file_holding_code_is_refused_before_it_runs(tmp_path, name):
    import os

    import torch

    from dpo.resume import check_resume

    class RunsCode:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    out = fake_run(tmp_path / "run")
    torch.save({"x": RunsCode()}, out / "checkpoint-1" / name)
    with pytest.raises(JobError, match=rf"{name} cannot be loaded safely \(it holds pickled objects other than "
                                       r"tensors and plain values: GLOBAL posix.system\)") as e:
        check_resume(str(out / "checkpoint-1"), out)
    assert "weights_only=False" not in str(e.value) and not (tmp_path / "ran").exists()


def test_overwrite_retires_only_the_earlier_runs_own_files(tmp_path):
    from dpo.resume import overwrite_plan, start_run

    out = fake_run(tmp_path / "run")
    (out / "notes.txt").write_text("mine")
    (out / "model.safetensors").write_bytes(b"final model of the earlier run")
    (out / "checkpoint-3").mkdir()  # half saved by the earlier run, record written first
    (out / "checkpoint-3" / "refcache-reference.json").write_text(json.dumps({"cache": None, "run_id": "a" * 32}))
    retire, left = overwrite_plan(out)
    assert sorted(p.name for p in retire) == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "metrics.jsonl",
                                              "refcache-run.json"]
    assert sorted(p.name for p in left) == ["model.safetensors", "notes.txt"]
    notes = []
    cfg = config(tmp_path, out, overwrite_output_dir=True)
    run_id = start_run(cfg, notes.append)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "notes.txt", "refcache-run.json"]
    assert json.loads((out / "refcache-run.json").read_text())["run_id"] == run_id != "a" * 32
    assert "removed the earlier run's" in notes[0] and "left model.safetensors, notes.txt" in notes[0]


@pytest.mark.parametrize("planted", ["symlinked_checkpoint", "foreign_checkpoint", "symlinked_manifest",
                                     "foreign_metrics", "metrics_png_not_a_png", "foreign_readme", "symlinked_card"])
def test_overwrite_refuses_what_is_in_the_way_and_not_provably_ours(tmp_path, planted):
    from dpo.resume import overwrite_plan

    out = fake_run(tmp_path / "run")
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "file").write_text("keep")
    name = {"symlinked_checkpoint": "checkpoint-9", "foreign_checkpoint": "checkpoint-9",
            "symlinked_manifest": "run-manifest.json", "foreign_metrics": "metrics.jsonl",
            "metrics_png_not_a_png": "metrics.png", "foreign_readme": "README.md", "symlinked_card": "README.md"}[planted]
    if planted == "symlinked_checkpoint":
        (out / name).symlink_to(precious, target_is_directory=True)
    elif planted == "foreign_checkpoint":
        (out / name).mkdir()
    elif planted == "symlinked_manifest":
        (out / name).symlink_to(precious / "file")
    elif planted == "foreign_metrics":
        (out / name).write_text("my lab notebook\n")
    elif planted == "foreign_readme":  # a user's card (the run's own is tagged refcache: test_model_card.py)
        (out / name).write_text("---\nlicense: mit\ntags:\n- dpo\n---\n# my notes on this run\n")
    elif planted == "symlinked_card":  # a link to a card of ours elsewhere is still a link
        (precious / "file").write_text("---\ntags:\n- refcache\n---\n")
        (out / name).symlink_to(precious / "file")
    else:
        (out / name).write_text("not an image")
    before, kept = sorted(p.name for p in out.iterdir()), (precious / "file").read_text()
    with pytest.raises(JobError, match=rf"--overwrite-output-dir .*: {name}.* not an earlier train-dpo run's own"):
        overwrite_plan(out)
    assert sorted(p.name for p in out.iterdir()) == before and (precious / "file").read_text() == kept


def test_a_metrics_record_cut_off_by_a_full_disk_neither_blocks_a_resume_nor_an_overwrite(tmp_path):
    """Neighbour of item 15: the append of metrics.jsonl hit a full disk half way through a record."""
    from dpo.resume import overwrite_plan

    out = fake_run(tmp_path / "run")
    metrics = out / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 0.7}\n{"step": 2, "loss": 0.6}\n{"step": 3, "lo')
    assert prepare_metrics(metrics, str(out / "checkpoint-2")) == {(1, "train"), (2, "train")}
    metrics.write_text('{"step": 1, "loss": 0.7}\n{"step": 3, "lo')
    assert metrics in overwrite_plan(out)[0]
