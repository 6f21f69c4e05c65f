"""bench/run_all.py and the page it renders (bench/RESULTS.md): every bench_*.py there is can be run by name, an
unknown name is refused naming them all, and the page carries a section for each part with results and the retired
parts' last figures."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import REPO

BENCH = REPO / "bench"


def run_all(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "run_all.py"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def render():
    sys.path.insert(0, str(BENCH))  # the bench scripts import their harness (common, report) by name
    try:
        import render

        yield render
    finally:
        sys.path.remove(str(BENCH))


def test_an_unknown_part_is_refused_naming_every_part_there_is():
    proc = run_all("--parts", "precompute,ranks", "--render-only")
    assert proc.returncode == 2
    assert "error: no part ranks; the parts: " in proc.stderr
    named = proc.stderr.strip().split("the parts: ")[1].split(", ")
    assert sorted(f"bench_{n.replace('-', '_')}.py" for n in named) == sorted(p.name for p in BENCH.glob("bench_*.py"))


def test_the_page_has_each_part_with_results_and_the_retired_parts(tmp_path, render):
    shutil.copytree(BENCH / "results", tmp_path / "results")
    proc = run_all("--render-only", "--results", str(tmp_path / "results"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (tmp_path / "RESULTS.md").read_text()
    rendered = {part for part, _, _ in render.SECTIONS if list((tmp_path / "results").glob(f"{part}-cpu*.json"))}
    assert rendered, "no results to render"
    for part, title, _ in render.SECTIONS:
        if part in rendered:
            assert f"### {title}" in page, part
        assert (BENCH / f"bench_{part.replace('-', '_')}.py").exists(), f"section of a part with no script: {part}"
    retired = (BENCH / "retired.md").read_text().strip()
    assert retired in page and page.index("## Retired parts") > page.index("## GPU check")
