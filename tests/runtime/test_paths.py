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


# ---------------------------------------------------------------------------------------------------------------
# every place is a location (storage.places.location), never compared as text (issue 34, family 1)


@pytest.mark.parametrize("spelling", ["file://{}", "file://localhost{}", "{}"])
def test_a_file_url_is_the_place_it_names(tmp_path, model, spelling):
    out = spelling.format(model / "out")
    with pytest.raises(JobError, match=r"is inside --model"):
        check_apart(out, "--out", {"--model": model})
    with pytest.raises(JobError, match=r" is --out "):
        check_apart(model / "off", "--offload-folder", {"--out": spelling.format(model / "off")})
    check_apart(spelling.format(tmp_path / "apart"), "--out", {"--model": f"file://{model}"})


def test_store_places_are_compared_with_store_places_only(tmp_path, model):
    with pytest.raises(JobError, match=r"an object-store URL is taken where refcache writes or reads a cache"):
        check_apart("memory://bucket/run", "--output-dir", {"--model": model})
    with pytest.raises(JobError, match=r"memory:///bucket/c/x is inside --ref-cache memory://bucket/c:"):
        check_apart("memory://bucket/c/x", "--out", {"--ref-cache": "memory://bucket/c", "--model": model},
                    on_store=True)
    check_apart("memory://bucket/d", "--out", {"--ref-cache": "memory://bucket/c", "--model": model}, on_store=True)
    with pytest.raises(JobError, match=r"--out simplecache::s3://b/x: the fsspec protocol chain simplecache::s3"):
        check_apart("simplecache::s3://b/x", "--out", {}, on_store=True)


# ---------------------------------------------------------------------------------------------------------------
# one rule for a single file written (issue 34, family 2)


def test_a_single_output_file_is_checked_by_the_one_rule(tmp_path, model):
    from runtime.paths import check_output_file, write_output_file
    from storage.files import UnsafeDestination

    mine = lambda p: p.read_bytes().startswith(b"ours")
    rule = dict(ours=mine, kind="a report")
    inputs = {"--model": model}
    with pytest.raises(JobError, match=r"is inside --model"):
        check_output_file(model / "tokenizer.json", "--json", inputs, **rule)
    with pytest.raises(JobError, match=r"its folder .*nowhere does not exist"):
        check_output_file(tmp_path / "nowhere" / "r.json", "--json", inputs, **rule)
    with pytest.raises(JobError, match=r"an object-store URL"):
        check_output_file("memory://bucket/r.json", "--json", inputs, **rule)
    (tmp_path / "target").write_text("precious")
    (tmp_path / "link.json").symlink_to(tmp_path / "target")
    with pytest.raises(UnsafeDestination, match=r"is a symlink"):
        check_output_file(tmp_path / "link.json", "--json", inputs, **rule)
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(UnsafeDestination, match=r"is a folder"):
        check_output_file(tmp_path / "dir.json", "--json", inputs, **rule)
    (tmp_path / "notes.json").write_text("my notes")
    with pytest.raises(JobError, match=r"notes.json already exists and is not a report refcache wrote"):
        write_output_file(tmp_path / "notes.json", "--json", inputs, b"ours 2", **rule)
    assert (tmp_path / "target").read_text() == "precious" and (tmp_path / "notes.json").read_text() == "my notes"
    for data in (b"ours 1", b"ours 2"):  # new, then its own replaced
        write_output_file(f"file://localhost{tmp_path}/r.json", "--json", inputs, data, **rule)
        assert (tmp_path / "r.json").read_bytes() == data
