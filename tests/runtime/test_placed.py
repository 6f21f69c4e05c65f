"""runtime/placed.py: the placement options are declared once (Placement) and every command that loads a split model
includes them whole (issue 38): the group's fields are enumerated here, so a field added to the group that some
command, --config or TRL's ref_model_init_kwargs would not take fails."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import click
import pytest
from click.testing import CliRunner

from runtime.options import field_help, option_specs
from runtime.errors import JobError
from runtime.placed import Attention, Placement, group_options, included, prefix_of


def commands() -> dict:
    """{command: (its click command, its config class, the prefix of its placement options)}."""
    from audit.cli import AuditOptions
    from audit.cli import main as audit
    from dpo.cli import main as train
    from dpo.config import TrainConfig
    from precompute.cli import main as precompute
    from precompute.config import PrecomputeConfig

    return {"precompute-ref": (precompute, PrecomputeConfig, ""), "train-dpo": (train, TrainConfig, "ref_"),
            "audit-ref": (audit, AuditOptions, "")}


def test_the_group_holds_the_options_of_the_issue():
    assert {"device_map", "max_memory", "offload_folder"} <= set(group_options(Placement))


@pytest.mark.parametrize("command", ["precompute-ref", "train-dpo", "audit-ref"])
def test_every_command_takes_every_option_of_the_group_as_declared(command):
    """Name (with the command's prefix), both spellings, type, choices and default are the group's own."""
    cmd, config, prefix = commands()[command]
    assert prefix_of(config, Placement) == prefix
    params = {p.name: p for p in cmd.params}
    declared = {s.name: s for s in option_specs(Placement)}
    group = {f.name: f for f in dataclasses.fields(Placement)}
    own = {f.name: f for f in dataclasses.fields(config)}
    for name in group_options(Placement):
        param = params[prefix + name]
        assert param.opts == ["--" + (prefix + name).replace("_", "-"), "--" + prefix + name]
        assert type(param.type) is type(declared[name].kind)
        assert getattr(param.type, "choices", None) == getattr(declared[name].kind, "choices", None)
        assert own[prefix + name].default == group[name].default
        rest = lambda f: {k: v for k, v in f.metadata.items() if k not in ("help", "group")}
        assert rest(own[prefix + name]) == rest(group[name])  # parse, location, choices, show_default
    # the help names the group's options as this command spells them
    assert f"With --{prefix.replace('_', '-')}device-map: the memory" in params[prefix + "max_memory"].help


def test_train_dpo_takes_the_group_in_a_config_file_and_as_trl_ref_model_init_kwargs(tmp_path):
    from dpo.config_file import REF_INIT_KWARGS, load_config_file

    assert REF_INIT_KWARGS == {name: "ref_" + name for name in group_options(Placement)}
    path = tmp_path / "run.yaml"
    path.write_text("ref_device_map: sequential\nref_max_memory: 2GiB\n")
    assert load_config_file(str(path)) == {"ref_device_map": "sequential", "ref_max_memory": f"cpu={2 * 2**30}"}
    path.write_text("ref_device_map: everywhere\n")
    with pytest.raises(click.UsageError, match="run.yaml: ref_device_map: 'everywhere' is not one of 'auto'"):
        load_config_file(str(path))


def test_a_config_made_in_code_reads_the_group_as_the_command_line_does(tmp_path):
    """The budget in its one form, the offload folder by the location type; Placement.of hands them on whole."""
    from dpo.config import TrainConfig
    from precompute.config import PrecomputeConfig

    cfg = PrecomputeConfig(model="m", data="d", device_map="auto", max_memory="0=1GiB, cpu=2GiB",
                           offload_folder=f"file://{tmp_path}/off")
    placed = Placement.of(cfg)
    assert cfg.max_memory == placed.max_memory == f"0={2**30},cpu={2 * 2**30}"
    assert placed.offload_folder == tmp_path / "off" and placed.split and placed.prefix == ""
    with pytest.raises(click.BadParameter, match="'lots' is not a memory size") as refused:
        TrainConfig(model="m", data="d", output_dir=str(tmp_path / "o"), ref_max_memory="lots")
    assert "Invalid value for '--ref-max-memory'" in refused.value.format_message()
    train = Placement.of(TrainConfig(model="m", data="d", output_dir=str(tmp_path / "o"), ref_max_memory="1GiB"))
    assert train.given() == ["--ref-max-memory"] and not train.split
    with pytest.raises(JobError, match="--ref-max-memory place a model split by --ref-device-map; add "
                                       "--ref-device-map auto"):
        train.check()


def test_a_field_added_to_a_group_is_an_option_of_a_config_that_includes_it():
    """What makes a new placement option one declaration: a group's field reaches the including class, in its
    place, with its metadata, under the prefix; a name the class declares itself is refused."""

    @dataclass(frozen=True)
    class Group:
        budget: int | None = field(default=None, metadata=field_help("With --budget-size: N.", domain="count"))
        budget_size: str | None = field(default=None, metadata=field_help("Size; see --budget."))

    @dataclass
    @included(Group, prefix="x_", after="a", section="S", notes={"budget": "Here."})
    class Config:
        a: int = field(default=1, metadata=field_help("A.", domain="count"))
        b: int = field(default=2, metadata=field_help("B.", domain="count"))

    assert [f.name for f in dataclasses.fields(Config)] == ["a", "x_budget", "x_budget_size", "b"]
    specs = {s.name: s for s in option_specs(Config)}
    assert specs["x_budget"].decls == ("--x-budget", "--x_budget") and specs["x_budget"].group == "S"
    assert specs["x_budget"].kind.domain == "count"
    assert specs["x_budget"].help.startswith("With --x-budget-size: N. Here.")
    assert specs["x_budget_size"].help.startswith("Size; see --x-budget.")
    with pytest.raises(TypeError, match="x_budget declared by the class and by Group"):
        @included(Group, prefix="x_", after="a")
        class Twice:
            a: int = 1
            x_budget: int = 2


def test_attention_is_one_declaration_for_precompute_ref_and_train_dpo():
    for command in ("precompute-ref", "train-dpo"):
        _, config, _ = commands()[command]
        assert prefix_of(config, Attention) == ""
        fld = next(f for f in dataclasses.fields(config) if f.name == "attn_implementation")
        assert fld.default == "auto" and fld.metadata["help"].startswith(
            dataclasses.fields(Attention)[0].metadata["help"])


def test_audit_ref_views_refuse_every_option_of_the_group(tmp_path):
    """--show/--html are views, not the audit: every placement option given with them is refused naming it."""
    from audit.cli import main

    for name in group_options(Placement):
        flag = "--" + name.replace("_", "-")
        value = {"device_map": "auto", "max_memory": "1GiB", "offload_folder": str(tmp_path / "off")}[name]
        result = CliRunner().invoke(main, [str(tmp_path), "--show", "0", flag, value])
        assert result.exit_code == 2 and f"({flag})" in result.output, result.output


@pytest.mark.parametrize("command", ["precompute-ref", "train-dpo"])
def test_a_hub_kernel_runs_only_with_trust_remote_code(command, tmp_path):
    """Found by the hostile pass: `--attn-implementation kernels-community/flash-attn` passed to from_pretrained,
    which (with the kernels package and a network) downloads and runs the kernel's code without --trust-remote-code."""
    from dpo.config import TrainConfig
    from precompute.config import PrecomputeConfig
    from runtime.placed import attention_of

    make = {"precompute-ref": lambda **kw: PrecomputeConfig(model="m", data="d", out=str(tmp_path / "o"), **kw),
            "train-dpo": lambda **kw: TrainConfig(model="m", data="d", output_dir=str(tmp_path / "r"), **kw)}[command]
    with pytest.raises(JobError, match="a hub kernel is code downloaded from the hub and run.*--trust-remote-code"):
        attention_of(make(attn_implementation="kernels-community/flash-attn"))
    allowed = make(attn_implementation="kernels-community/flash-attn", trust_remote_code=True)
    assert attention_of(allowed) == "kernels-community/flash-attn"
    assert attention_of(make(attn_implementation="sdpa")) == "sdpa" and attention_of(make()) is None


@pytest.mark.parametrize("text, ok", [("kernels-community/flash-attn", True), ("org/name@v1", True),
                                      ("org/name:kernel", True), ("a/b; rm -rf ~", False), ("a/b c", False),
                                      ("/etc/passwd", False), ("a/b/c", False), ("../x", False)])
def test_a_hub_kernel_value_has_a_repo_ids_form(text, ok):
    """Found by a helper: any text holding '/' passed as a hub kernel (and, recorded in a cache, could come back
    in a remedy as 'pass --attn-implementation a/b; rm -rf ~')."""
    from runtime.placed import parse_attention

    if ok:
        assert parse_attention(text) == text
    else:
        with pytest.raises(ValueError, match="is not a hub kernel's id"):
            parse_attention(text)


def test_flex_attention_is_refused_only_where_the_run_computes_on_the_cpu(monkeypatch):
    """runtime.placed.check_flex_here (issue 36): on a CUDA machine flex_attention is taken unless --device cpu (or
    train-dpo's --use-cpu) puts the run on the CPU; without CUDA it is refused whatever the options say."""
    from types import SimpleNamespace

    import torch

    from runtime.errors import JobError
    from runtime.placed import check_flex_here

    cfg = SimpleNamespace(attn_implementation="flex_attention", device="cpu", use_cpu=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_flex_here(cfg, None)
    check_flex_here(cfg, "auto")
    with pytest.raises(JobError, match="--attn-implementation flex_attention needs a CUDA device, and --device cpu "
                                       "runs it on the CPU"):
        check_flex_here(cfg, "cpu")
    with pytest.raises(JobError, match="and --use-cpu runs it on the CPU"):
        check_flex_here(cfg, "cpu", "use_cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(JobError, match="and this machine has none"):
        check_flex_here(cfg, None)
    check_flex_here(SimpleNamespace(attn_implementation="sdpa"), None)
