"""runtime/paths.py: an output folder is refused when it is, contains or is inside an input (paths resolved, so a
symlink or a `..` does not hide the relation); folders apart from every input pass."""

from __future__ import annotations

import pytest

from runtime.errors import JobError
from runtime.paths import check_apart


@pytest.fixture()
def model(tmp_path):
    (tmp_path / "models" / "sft").mkdir(parents=True)
    return tmp_path / "models" / "sft"


@pytest.mark.parametrize("out, relation", [("models/sft", "is"), ("models/sft/out", "is inside"),
                                           ("models", "contains"), ("models/sft/../sft", "is")])
def test_output_related_to_an_input_is_refused_naming_both(tmp_path, model, out, relation):
    with pytest.raises(JobError) as e:
        check_apart(tmp_path / out, "--out", {"--data": tmp_path / "prefs.jsonl", "--model": model})
    assert f"--out {tmp_path / out} {relation} --model {model}:" in str(e.value)
    assert "choose an --out apart from it" in str(e.value)


def test_a_symlink_to_an_input_is_the_input(tmp_path, model):
    (tmp_path / "link").symlink_to(model)
    with pytest.raises(JobError, match=r"link is --model"):
        check_apart(tmp_path / "link", "--out", {"--model": model})


def test_apart_and_unset_inputs_pass(tmp_path, model):
    check_apart(tmp_path / "models" / "sft-cache", "--out", {"--model": model, "--ref-model": None})  # a sibling
    check_apart(tmp_path / "out", "--out", {})


def test_an_output_file_inside_or_linked_to_an_input_is_refused(tmp_path, model):
    """The same rule for a file (audit-ref --json): inside an input folder, through `..`, or another name (hard link)
    of an input file."""
    data = tmp_path / "prefs.jsonl"
    data.write_text("{}\n")
    for out, relation, option in [(model / "config.json", "is inside", "--model"),
                                  (model / ".." / "sft" / "report.json", "is inside", "--model"),
                                  (data, "is", "--data")]:
        with pytest.raises(JobError, match=rf"--json {out} {relation} {option} "):
            check_apart(out, "--json", {"--model": model, "--data": data})
    (tmp_path / "report.json").hardlink_to(data)
    with pytest.raises(JobError, match=r"report.json is --data"):
        check_apart(tmp_path / "report.json", "--json", {"--data": data})
    check_apart(tmp_path / "audit.json", "--json", {"--model": model, "--data": data})
