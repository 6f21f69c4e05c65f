"""One location type for every path-or-URL option of every command (issue 34, family 1): runtime.locations.Location, which
reads the text with storage.places.location. The options are found by walking the click commands' parameters, not
listed here, so a new option that names a path without declaring `location` metadata fails
test_every_option_that_names_a_path_is_a_location."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import click
import pytest

from runtime.locations import PRESENT, Location
from storage import places


def commands() -> dict:
    from audit.cli import main as audit
    from dpo.cli import main as train
    from precompute.cli import main as precompute

    return {"precompute-ref": precompute, "train-dpo": train, "audit-ref": audit}


def params():
    return [(name, p) for name, cmd in commands().items() for p in cmd.params if p.name not in ("help",)]


def locations():
    return [(name, p) for name, p in params() if isinstance(p.type, Location)]


def ident(value) -> str:
    name, p = value if isinstance(value, tuple) else (None, value)
    return f"{name}:{p.name}" if name else str(value)


# What makes a parameter's help say it names a place; a flag (a yes/no) never does.
NAMES_A_PLACE = re.compile(r"\b(paths?|files?|folders?|director(y|ies)|dirs?|urls?|prefix)\b", re.I)
# Options whose help mentions a place without taking one, and why.
NOT_A_PLACE = {"split": "a split's name; the file or folder it selects is found under --data",
               "data_config": "a name among the dataset card's configs; the files it selects are found under --data"}


@pytest.mark.parametrize("command, param", params(), ids=ident)
def test_every_option_that_names_a_path_is_a_location(command, param):
    """A parameter whose help (or name) speaks of a path, file, folder, directory, URL or prefix, or that click
    checks as a path, is read by the Location type; any other parameter is not."""
    if isinstance(param, click.Option) and param.is_flag:
        assert not isinstance(param.type, Location)
        return
    text = f"{getattr(param, 'help', None) or ''} {param.name.replace('_', ' ')}"
    looks = isinstance(param.type, click.Path) or bool(NAMES_A_PLACE.search(text))
    if isinstance(param.type, Location):
        assert param.type.role in ("input", "output")
    elif param.name in NOT_A_PLACE:
        assert not isinstance(param.type, click.Path)
    else:
        assert not looks, (f"{command} --{param.name.replace('_', '-')} names a place: declare "
                           "metadata={'location': 'input'|'output'} (runtime.locations.Location)")


def test_the_enumeration_finds_every_known_path_option():
    """The walk above sees the path options of the issue (so it is not vacuous)."""
    found = {(c, p.name) for c, p in locations()}
    expected = {("precompute-ref", n) for n in ("model", "data", "out", "adapter", "offload_folder")} | {
        ("train-dpo", n) for n in ("model", "data", "output_dir", "ref_cache", "ref_model", "ref_offload_folder",
                                   "eval_data", "eval_ref_cache", "resume_from_checkpoint", "fsdp_config",
                                   "deepspeed", "init_adapter", "config_file", "accelerator_config")} | {
        ("audit-ref", n) for n in ("cache", "model", "data", "run", "json", "html", "tokenizer", "offload_folder")}
    assert expected <= found, expected - found


def _target(param, tmp_path) -> Path:
    """A local place the parameter's own checks accept: made where it must exist (a folder or a file)."""
    where = tmp_path / "place"
    local = param.type.local
    if local is not None and local.exists:
        if local.file_okay and not local.dir_okay:
            where.write_text("{}")
        else:
            where.mkdir()
    return where


@pytest.mark.parametrize("command, param", locations(), ids=ident)
@pytest.mark.parametrize("form", ["file://{}", "file://localhost{}", "{}"])  # {}: an absolute path
def test_every_location_reads_file_urls_as_the_local_path(command, param, form, tmp_path):
    where = _target(param, tmp_path)
    value = param.type.convert(form.format(where), param, None)
    assert isinstance(value, Path) and value == where  # never ./localhost/..., never a folder named `file:`


@pytest.mark.parametrize("command, param", locations(), ids=ident)
@pytest.mark.parametrize("text, named", [
    ("simplecache::s3://bucket/x", "simplecache::s3"), ("filecache::memory://bucket/x", "filecache::memory"),
    ("file://otherhost/tmp/x", "'otherhost'"), ("http://example.com/x", "http://"), ("zip://a.zip", "zip://"),
    ("s3:/bucket/x", "no '//'"), ("", "empty"), ("d1/tr\n  remedy: run this\nain.jsonl", "a control character"),
    ("c\x1b]0;title\x07", "a control character"), ("--overwrite", "reads as an option")])
def test_every_location_refuses_what_it_cannot_take_naming_it(command, param, text, named):
    with pytest.raises(click.BadParameter) as e:
        param.type.convert(text, param, None)
    assert named in e.value.message


@pytest.mark.parametrize("command, param", locations(), ids=ident)
def test_a_store_url_only_where_a_cache_is_written_or_read(command, param):
    """memory:// (fsspec's in-process store) stands for every store: a StorePath where the option takes a cache,
    refused by name elsewhere."""
    takes = {("precompute-ref", "out"), ("train-dpo", "ref_cache"), ("train-dpo", "eval_ref_cache"),
             ("audit-ref", "cache")}
    assert param.type.store == ((command, param.name) in takes)
    if param.type.store:
        value = param.type.convert("memory://bucket/cache", param, None)
        assert isinstance(value, places.StorePath) and value.url == "memory:///bucket/cache"
    else:
        with pytest.raises(click.BadParameter, match="an object-store URL is taken where refcache writes or reads "
                                                     "a cache"):
            param.type.convert("memory://bucket/cache", param, None)


@pytest.mark.parametrize("command, param", locations(), ids=ident)
def test_the_command_line_refuses_with_exit_2_naming_the_option(command, param, tmp_path, monkeypatch):
    """Through click itself: exit 2, the option named, nothing made in the working folder."""
    from click.testing import CliRunner

    monkeypatch.chdir(tmp_path)
    cmd = commands()[command]
    value = "simplecache::s3://bucket/x"
    args = [value] if isinstance(param, click.Argument) else [tmp_path] + [param.opts[0], value]
    if command == "precompute-ref" and param.name not in ("model", "data"):
        args = ["--model", "m", "--data", "d", param.opts[0], value]
    elif command == "audit-ref" and param.name != "cache":
        args = [tmp_path, param.opts[0], value]
    elif command == "train-dpo":
        args = [param.opts[0], value]
    result = CliRunner().invoke(cmd, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    assert "simplecache::s3 is not supported" in result.output
    shown = param.opts[0] if isinstance(param, click.Option) else param.name.upper()
    assert shown in result.output
    assert list(tmp_path.iterdir()) == []


def _must_exist(param) -> bool:
    return isinstance(param.type.local, click.Path) and param.type.local.exists


@pytest.mark.parametrize("command, param", [(c, p) for c, p in locations() if _must_exist(p)], ids=ident)
def test_a_typo_in_a_place_that_must_exist_is_answered_with_the_closest_name(command, param, tmp_path):
    """Found by the UX pass: audit-ref's typo'd CACHE or --run got click's bare "does not exist". Every option whose
    place must exist names what its folder holds and the closest name there."""
    local = param.type.local
    real = tmp_path / ("checkpoint-40" if local.dir_okay else "settings-40.yaml")
    real.mkdir() if local.dir_okay else real.write_text("{}")
    typo = real.with_name(real.name.replace("40", "4O"))
    with pytest.raises(click.BadParameter) as e:
        param.type.convert(str(typo), param, None)
    assert f"did you mean {real}?" in e.value.message and f"{tmp_path} holds: {real.name}" in e.value.message


def test_the_options_whose_place_must_exist(tmp_path):
    assert {(c, p.name) for c, p in locations() if _must_exist(p)} >= {("audit-ref", "cache"), ("audit-ref", "run"),
                                                                      ("train-dpo", "config_file")}


def present_fields() -> list[tuple[str, str, str]]:
    """(command, field, what it must hold) of every option whose place the job checks before reading it (a field's
    `present` metadata: a hub id or a store URL may stand there, so click cannot check it at parse time)."""
    from dpo.config import TrainConfig
    from precompute.config import PrecomputeConfig

    return [(command, f.name, f.metadata["present"]) for command, config in (("precompute-ref", PrecomputeConfig),
                                                                           ("train-dpo", TrainConfig))
            for f in dataclasses.fields(config) if f.metadata.get("present")]


def test_the_options_the_job_checks_are_there():
    assert {(c, n) for c, n, _ in present_fields()} >= {("precompute-ref", "model"), ("precompute-ref", "data"), *(
        ("train-dpo", n) for n in ("model", "data", "ref_cache", "ref_model", "eval_data", "eval_ref_cache"))}
    assert {kind for _, _, kind in present_fields()} == set(PRESENT)


def _good_args(command, llama_dir, dpo_data, dpo_cache, tmp_path) -> dict:
    if command == "precompute-ref":
        return {"--model": llama_dir, "--data": dpo_data, "--out": tmp_path / "cache", "--no-progress": None}
    return {"--model": llama_dir, "--data": dpo_data, "--ref-cache": dpo_cache, "--output-dir": tmp_path / "run",
            "--use-cpu": None, "--max-steps": 1, "--eval-data": dpo_data, "--eval-ref-cache": dpo_cache}


def _run(command, args: dict):
    from click.testing import CliRunner

    words = [str(w) for k, v in args.items() for w in ([k] if v is None else [k, v])]
    return CliRunner().invoke(commands()[command], words)


@pytest.mark.parametrize("command, name, kind", present_fields(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_place_the_job_reads_that_is_not_there_is_refused_naming_the_option(command, name, kind, llama_dir,
                                                                              dpo_data, dpo_cache, tmp_path):
    """Found by the UX pass: `--ref-cache c33` was refused as "c33 holds no cache ...", naming no option. Every
    option whose place the job checks names itself, as typed (with the closest names), or in a --config file the
    file and its key; exit 2, nothing written."""
    flag = "--" + name.replace("_", "-")
    real, tie = tmp_path / "place-40", tmp_path / "place-48"
    real.mkdir()
    tie.mkdir()
    typo = tmp_path / "place-4O"  # as near place-40 as place-48: both are named (storage.nearby)
    args = _good_args(command, llama_dir, dpo_data, dpo_cache, tmp_path) | {flag: typo}
    result = _run(command, args)
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert f"error: {flag} {typo}: does not exist; did you mean {real} or {tie}?" in said, said
    trl = {"model": "model_name_or_path", "data": "dataset_name"}.get(name)
    for typed in {"--" + name, f"--{trl}" if trl else None} - {None, flag}:  # named as typed (issue 36)
        result = _run(command, {k: v for k, v in args.items() if k != flag} | {typed: typo})
        assert result.exit_code == 2, result.output
        assert f"error: {typed} {typo}: does not exist" in " ".join(result.output.split()), result.output
    if kind == "data":  # a mistyped path that reads as a hub id (org/name): named too, never a download hint
        result = _run(command, {k: v for k, v in args.items() if k != flag} | {f"--{trl or name}": "d2/train.jsonl"})
        assert result.exit_code == 2, result.output
        said = " ".join(result.output.split())
        assert (f"error: --{trl or name} d2/train.jsonl: does not exist (nor does d2; the nearest folder that does is .); a "
                "name ending in .jsonl is read as a local file, not a hub data set id") in said, said
    config = tmp_path / "run.yaml"
    config.write_text(f"{name}: {typo}\n")
    result = _run(command, {k: v for k, v in args.items() if k != flag} | {"--config": config})
    assert result.exit_code == 2, result.output
    assert f"error: {config}: {name}: {typo}: does not exist" in " ".join(result.output.split()), result.output
    for written in {name.replace("_", "-"), trl} - {None}:  # named as the file wrote it (UX pass)
        config.write_text(f"{written}: {typo}\n")
        result = _run(command, {k: v for k, v in args.items() if k != flag} | {"--config": config})
        assert result.exit_code == 2, result.output
        assert f"error: {config}: {written}: {typo}: does not exist" in " ".join(result.output.split()), result.output
    if kind != "data":  # a folder that is there but is not what the option takes
        result = _run(command, args | {flag: real})
        assert result.exit_code == 2, result.output
        said = " ".join(result.output.split())
        assert {"checkpoint": f"error: {flag} {real}: not a Hugging Face checkpoint folder (no config.json)",
                "cache": f"error: {flag} {real} holds no cache (it is empty)"}[kind] in said, said
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("command, param", [(c, p) for c, p in locations() if _must_exist(p)], ids=ident)
def test_a_place_click_checks_is_refused_naming_the_option(command, param, tmp_path):
    """The options whose place click checks as it parses: their refusal names the option too."""
    with pytest.raises(click.BadParameter) as e:
        param.type.convert(str(tmp_path / "nowhere"), param, None)
    shown = param.opts[0] if isinstance(param, click.Option) else param.name.upper()
    assert shown in e.value.format_message() or shown.lower() in e.value.format_message().lower()


def test_config_files_read_their_paths_by_the_same_type(tmp_path):
    """train-dpo --config: every location key is read as on the command line (TRL's names included)."""
    from dpo.config_file import _convert
    from dpo.options import LORA, OURS

    keys = [k for k, f in OURS.items() if "location" in f.metadata]
    assert {"model", "output_dir", "ref_cache", "init_adapter"} <= set(keys)
    (tmp_path / "x.json").write_text("{}")  # --deepspeed and --fsdp-config must name a file that is there
    for key in keys:
        name = "x.json" if key in ("deepspeed", "fsdp_config") else "x"
        assert _convert("run.yaml", key, f"file://localhost{tmp_path}/{name}") == tmp_path / name, key
        with pytest.raises(click.UsageError, match=rf"run.yaml: {key}: .*simplecache::s3 is not supported"):
            _convert("run.yaml", key, "simplecache::s3://bucket/x")
    assert _convert("run.yaml", "resume_from_checkpoint", True) == "true"
    assert _convert("run.yaml", "deepspeed", {"zero_optimization": {"stage": 2}}) == {"zero_optimization": {"stage": 2}}
    with pytest.raises(click.UsageError, match="run.yaml: output_dir: 5 is not a path"):
        _convert("run.yaml", "output_dir", 5)
    assert "init_adapter" in LORA


def test_configs_made_in_python_read_their_paths_the_same_way(tmp_path):
    from audit.cli import AuditOptions
    from dpo.config import TrainConfig
    from precompute.config import PrecomputeConfig

    cfg = PrecomputeConfig(model=f"file://{tmp_path}/m", data="org/name", out="memory://bucket/c",
                           offload_folder=f"file://localhost{tmp_path}/off")
    assert cfg.model == tmp_path / "m" and cfg.data == Path("org/name")  # a hub id stays what it says
    assert isinstance(cfg.out, places.StorePath) and cfg.offload_folder == tmp_path / "off"
    t = TrainConfig(model="m", data="d", output_dir=f"file://localhost{tmp_path}/run", resume_from_checkpoint="true")
    assert t.output_dir == tmp_path / "run" and t.resume_from_checkpoint == "true"
    with pytest.raises(click.BadParameter, match="object-store URL"):
        TrainConfig(model="m", data="d", output_dir="s3://bucket/run")
    assert AuditOptions(html=f"file://{tmp_path}/p.html").html == tmp_path / "p.html"


@pytest.mark.parametrize("text, expected", [
    ("file:///a/b%20c", "/a/b c"), ("file://localhost/a", "/a"), ("rel/dir", "rel/dir"), ("./s3:x", "s3:x"),
    ("a::b", "a::b")])
def test_location_reads_local_paths(text, expected):
    assert places.location(text) == Path(expected)
    assert not places.is_remote(text)


def test_named_says_a_store_by_its_url_and_a_folder_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert places.named("memory://bucket/c") == "memory:///bucket/c"
    assert places.named("file://localhost/x/../y") == "/y" and places.named("c") == str(tmp_path / "c")


@pytest.mark.parametrize("text, named", [("memory://", "names no bucket"), ("s3://", "names no bucket"),
                                         ("file://", "absolute path"), ("file:relative", "no '//'"),
                                         ("file:///a?b", "query or fragment")])
def test_location_refuses_urls_naming_nothing(text, named):
    with pytest.raises(places.LocationError, match=re.escape(named)):
        places.location(text)


def _input_fields(config) -> set[str]:
    """Every field of a config dataclass (and of the dataclasses it holds) read as an input place."""
    names = set()
    for f in dataclasses.fields(config):
        if f.metadata.get("location") == "input":
            names.add(f.name)
        elif dataclasses.is_dataclass(f.type) or (isinstance(f.default_factory, type)
                                                   and dataclasses.is_dataclass(f.default_factory)):
            names |= _input_fields(f.default_factory if f.default_factory is not dataclasses.MISSING else f.type)
    return names


def _option(name: str) -> str:
    return "--config" if name == "config_file" else "--" + name.replace("_", "-")


def test_every_input_place_of_both_jobs_is_kept_apart_from_their_outputs(tmp_path):
    """Found by the hostile pass: precompute-ref's --config was not among the inputs its --out is kept apart from
    (a config named .refcache.lock inside --out was overwritten by the lock). Enumerated, so a new input option
    cannot skip it. train-dpo's --resume-from-checkpoint is its --output-dir's own checkpoint, by design."""
    from dpo.config import TrainConfig
    from dpo.outdir import inputs
    from precompute.config import PrecomputeConfig, checked_inputs

    root = Path(__file__).resolve().parents[1] / "data"
    (tmp_path / "adapter").mkdir()
    (tmp_path / "run.yaml").write_text("{}")
    pre = {"model": root / "sft-model", "data": root / "prefs" / "train.jsonl", "adapter": tmp_path / "adapter",
           "config_file": tmp_path / "run.yaml"}
    assert set(pre) == _input_fields(PrecomputeConfig)
    _, _, kept_apart = checked_inputs(PrecomputeConfig(**pre, out=tmp_path / "cache"))
    assert {_option(n) for n in pre} <= {k for k, v in kept_apart.items() if v is not None}

    train_inputs = _input_fields(TrainConfig) - {"resume_from_checkpoint", "init_adapter"}
    values = {n: tmp_path / n for n in train_inputs}
    for path in values.values():  # the DeepSpeed and FSDP configs are places only where a file is there
        path.write_text("{}")
    kept_apart = inputs(TrainConfig(**values, output_dir=tmp_path / "run"))
    assert {_option(n) for n in train_inputs} <= set(kept_apart), train_inputs - {k[2:] for k in kept_apart}
    assert "init_adapter" in _input_fields(TrainConfig) and "--init-adapter" in kept_apart


def _refused_cases():
    """(command, field, value, extra options, what the refusal says after the option's name) of values refused by a
    job's own checks (not by click's type): each is named as the user gave it (issue 36)."""
    return [
        ("train-dpo", "report_to", "foo", {}, lambda n, v: f"error: {n}foo: unknown tracker"),
        ("train-dpo", "resume_from_checkpoint", "{tmp}/nothere", {}, lambda n, v: f"error: {n}{v}: no such directory"),
        ("train-dpo", "resume_from_checkpoint", "true", {},
         lambda n, v: f"error: {n}true: no checkpoint-N folder in --output-dir"),
        ("train-dpo", "deepspeed", "{tmp}/bad.json", {}, lambda n, v: f"error: {n}{v}: not valid JSON"),
        ("train-dpo", "attn_implementation", "flex_attention", {},
         lambda n, v: f"error: {n}flex_attention needs a CUDA device, and --use-cpu runs it on the CPU"),
        ("train-dpo", "eval_ref_cache", "{cache}", {"--eval-data": "{tmp}/other.jsonl"},
         lambda n, v: f"not in the cache {v} ({n.rstrip(': ')})"),
        ("precompute-ref", "out", "{tmp}/nothere", {"--update": None},
         lambda n, v: f"error: --update {n}{v}: does not exist" if n.startswith("--") else
         f"error: --update: {n}{v}: does not exist"),
    ]


@pytest.mark.parametrize("command, name, value, extra, says", _refused_cases(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_a_refused_value_is_named_as_given(command, name, value, extra, says, llama_dir, dpo_data, dpo_cache,
                                           tmp_path):
    """Found by the UX pass (issue 36): a value from --config refused by the job's own checks was named by its flag,
    not by the file and the key as written (as the location refusals above are). Every spelling: both on the command
    line, both as a config file's key; exit 2, nothing written."""
    import json

    (tmp_path / "bad.json").write_text('{"zero_optimization":\n')
    rows = [json.loads(line) for line in Path(dpo_data).read_text().splitlines()]
    (tmp_path / "other.jsonl").write_text("".join(json.dumps({**r, "id": "x" + r["id"]}) + "\n" for r in rows))
    fill = lambda v: None if v is None else str(v).format(tmp=tmp_path, cache=dpo_cache)
    value = fill(value)
    args = _good_args(command, llama_dir, dpo_data, dpo_cache, tmp_path) | {k: fill(v) for k, v in extra.items()}
    kebab, snake = name.replace("_", "-"), name
    args.pop(f"--{kebab}", None)  # given below, in each spelling
    config = tmp_path / "run.yaml"
    forms = [(f"--{k}", f"--{k} ") for k in dict.fromkeys((kebab, snake))]
    forms += [(k, f"{config}: {k}: ") for k in dict.fromkeys((snake, kebab))]
    for given, named in forms:
        if given.startswith("--"):
            result = _run(command, args | {given: value})
        else:
            config.write_text(f"{given}: {json.dumps(value)}\n")
            result = _run(command, args | {"--config": config})
        assert result.exit_code == 2, (given, result.output)
        said = " ".join(result.output.split())
        assert says(named, value) in said, (given, said)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
