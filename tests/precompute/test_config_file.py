"""precompute-ref --config (found by the UX pass: train-dpo took a YAML of its options and TRL's spellings,
precompute-ref had no --config and suggested --data-config): the same reader as train-dpo's (runtime/config_file.py),
every value through its option's own type, the command line over the file. From the user's side: the command as typed,
the cache or the message asserted."""

from __future__ import annotations

import shlex

from support import manifest_of, pref_rows, precompute_cli, write_jsonl


def _yaml(path, text: str):
    path.write_text(text)
    return path


def test_a_yaml_config_with_trl_spellings_makes_the_cache_and_the_command_line_overrides_it(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", pref_rows(10))
    config = _yaml(tmp_path / "pc.yaml", f"model_name_or_path: {llama_dir}\ndataset_name: {data}\ntop_k: 4\n"
                                         "rows-per-shard: 4\nmax_length: 48\n")
    made = precompute_cli("--config", config, "--out", tmp_path / "a")
    assert made.exit_code == 0, made.output
    manifest = manifest_of(tmp_path / "a")
    assert (manifest["computation"]["top_k"], manifest["computation"]["rows_per_shard"]) == (4, 4)
    assert manifest["encoding"]["max_length"] == 48 and len(manifest["shards"]) == 3
    over = precompute_cli("--config", config, "--out", tmp_path / "b", "--top-k", 2)
    assert over.exit_code == 0, over.output
    assert manifest_of(tmp_path / "b")["computation"]["top_k"] == 2


def test_a_bad_config_is_a_usage_error_naming_the_file_the_key_and_the_reason(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", pref_rows(4))
    cases = {"unknown.yaml": (f"model: {llama_dir}\ndata: {data}\ntop_kk: 4\n", "unknown option(s) top_kk"),
             "value.yaml": (f"model: {llama_dir}\ndata: {data}\ntop_k: many\n", "top_k: 'many' is not a number"),
             "domain.yaml": (f"model: {llama_dir}\ndata: {data}\nrows_per_shard: 0\n", "rows_per_shard:"),
             "flag.yaml": (f"model: {llama_dir}\ndata: {data}\noverwrite: maybe\n", "overwrite: 'maybe' is not true"),
             "list.yaml": ("- model\n- data\n", "expected a mapping of option names to values"),
             "code.yaml": (f"model: !!python/object/apply:os.system ['touch {tmp_path}/owned']\n", "not valid YAML"),
             "missing.yaml": (f"data: {data}\n", "missing --model (on the command line or in --config)")}
    for name, (text, named) in cases.items():
        result = precompute_cli("--config", _yaml(tmp_path / name, text), "--out", tmp_path / "out")
        assert result.exit_code == 2, (name, result.output)
        assert named in result.output, (name, result.output)
        if name not in ("missing.yaml", "list.yaml"):
            assert name in result.output, (name, result.output)
    assert not (tmp_path / "out").exists() and not (tmp_path / "owned").exists()


def test_ctrl_c_with_a_config_prints_a_command_that_keeps_the_file_and_never_overwrites(llama_dir, tmp_path):
    from precompute.cli import main, resume_step

    data = write_jsonl(tmp_path / "d.jsonl", pref_rows(4))
    config = _yaml(tmp_path / "pc.yaml", f"model: {llama_dir}\ndata: {data}\noverwrite: true\n")
    ctx = main.make_context("precompute-ref", ["--config", str(config), "--out", str(tmp_path / "c"), "--top-k", "3"])
    options = {k: v for k, v in ctx.params.items() if k not in ("config_file", "debug")}
    words = shlex.split(resume_step(options, ctx.params["config_file"]).splitlines()[-1])
    assert words[:3] == ["precompute-ref", "--config", str(config)]
    assert "--no-overwrite" in words and "--overwrite" not in words and words[words.index("--top-k") + 1] == "3"


def test_disable_tqdm_is_no_progress_as_trl_spells_it(llama_dir, tmp_path):
    """Found by the UX pass: `precompute-ref --disable-tqdm` (TRL's, and train-dpo's, spelling) was 'No such
    option'; it is --no-progress, on the command line (with TRL's true/false word) and in a --config alike."""
    from click.testing import CliRunner

    from precompute.cli import main

    data = write_jsonl(tmp_path / "d.jsonl", pref_rows(4))

    def progress(*args) -> bool | None:
        return main.make_context("precompute-ref", ["--model", str(llama_dir), "--data", str(data),
                                                    *map(str, args)]).params["progress"]

    assert progress("--disable-tqdm") is False and progress("--disable_tqdm", "true") is False
    assert progress("--disable-tqdm", "false") is True and progress("--no-progress") is False
    assert progress() is None  # not given: the option's default
    config = _yaml(tmp_path / "pc.yaml", f"model: {llama_dir}\ndata: {data}\ndisable_tqdm: true\n")
    quiet = CliRunner().invoke(main, ["--config", str(config), "--out", str(tmp_path / "c")])
    assert quiet.exit_code == 0, quiet.output
    assert "pair/s" not in quiet.output and "s/pair" not in quiet.output and "4/4" not in quiet.output, quiet.output
    shown = CliRunner().invoke(main, ["--config", str(config), "--out", str(tmp_path / "c2"), "--disable-tqdm",
                                      "false"])
    assert shown.exit_code == 0 and "4/4" in shown.output, shown.output


def test_the_summary_quotes_a_path_as_a_shell_takes_it(llama_dir, tmp_path):
    """Found by the UX pass: the closing summary printed `to /x/my caches/c1`, which a copied command splits in
    two; it is quoted as the printed commands are (runtime.cli.shell_word, shlex)."""
    data = write_jsonl(tmp_path / "d.jsonl", pref_rows(4))
    out = tmp_path / "my caches" / "c1"
    made = precompute_cli("--model", llama_dir, "--data", data, "--out", out, "--no-progress")
    assert made.exit_code == 0, made.output
    line = next(x for x in made.output.splitlines() if x.startswith("wrote "))
    assert shlex.split(line.split(" to ", 1)[1]) == [str(out)], line
    assert f"to '{out}'" in line


def test_a_path_in_a_config_that_is_not_there_names_the_file_and_the_key(llama_dir, tmp_path):
    """Found by the UX pass: `model: nope` in a --config was refused as 'nope: does not exist', naming neither the
    file nor the key; --adapter's click check and --model's job check say both alike."""
    data = write_jsonl(tmp_path / "d.jsonl", pref_rows(4))
    for key, text in (("model", f"model: {tmp_path}/nope\ndata: {data}\n"),
                      ("data", f"model: {llama_dir}\ndata: {tmp_path}/nope.jsonl\n"),
                      ("adapter", f"model: {llama_dir}\ndata: {data}\nadapter: {tmp_path}/nope\n")):
        config = _yaml(tmp_path / f"{key}.yaml", text)
        result = precompute_cli("--config", config, "--out", tmp_path / "out")
        assert result.exit_code == 2, result.output
        assert f"{config}: {key}: {tmp_path}/nope" in " ".join(result.output.split()), result.output
        assert "does not exist" in result.output
    assert not (tmp_path / "out").exists()
