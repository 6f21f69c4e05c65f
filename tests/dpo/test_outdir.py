"""dpo/outdir.py: train-dpo's --output-dir is apart from every input, never a used folder unless asked or resuming,
and nothing is created while checking; metrics.jsonl keeps exactly the records up to the step a run resumes from."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dpo.outdir import check_output_dir, prepare_metrics
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
    (out / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(JobError, match=r"already holds files \(metrics.jsonl\).*--overwrite-output-dir"):
        check_output_dir(config(tmp_path, out))
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
    from schemas.files import UnsafeDestination

    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    (out / "checkpoint-2" / "optimizer.pt").hardlink_to(victim)
    with pytest.raises(UnsafeDestination, match=r"checkpoint-2/optimizer.pt is a hard link"):
        check_output_dir(config(tmp_path, out, overwrite_output_dir=True))
    (out / "checkpoint-2" / "optimizer.pt").unlink()
    (out / "checkpoint-2" / "optimizer.pt").symlink_to(victim)
    with pytest.raises(UnsafeDestination, match=r"checkpoint-2/optimizer.pt is a symlink"):
        check_output_dir(config(tmp_path, out, resume_from_checkpoint=str(out / "checkpoint-2")))
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
