"""The wheels a bare device lacks for the GPU check (issue 39): downloaded here, checked there.

    python3 bench/prepare_device.py [--dest .whl] [--python-version 3.12]   # here: download, check, sizes
    python3 bench/prepare_device.py --check [--dest .whl]                   # there, once they are installed

The device holds bench/device-image.txt's packages and reaches nothing outside; refcache's jobs need
bench/device-wheels.txt's beyond them. Here: pip downloads exactly those (no dependencies) as x86-64 manylinux
wheels, and checks that every requirement of every wheel is met by another carried wheel or the image's list, and
that the wheels and the working tree fit the device tool's 64 MiB. --check, there (bench/gpu_check.sh runs it):
each carried distribution is the one imported, its requirements are met, and the versions are printed. Exit 2 on a
failure, naming it.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "bench" / "device-wheels.txt"
IMAGE = REPO / "bench" / "device-image.txt"
DEST = REPO / ".whl"
LIMIT_MIB = 64  # the device tool's: the working tree that travels, carried paths included
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
# What the GPU check imports, for the versions it reports.
REPORTED = ("torch", "transformers", "accelerate", "peft", "huggingface-hub", "safetensors", "tokenizers", "numpy",
            "pyarrow", "polars", "polars-runtime-32", "datasets", "fsspec", "dill", "multiprocess", "pandas")


def fail(message: str):
    print(f"prepare_device: {message}", file=sys.stderr)
    raise SystemExit(2)


def norm(name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


def requirements(path: Path) -> list:
    """The requirement lines of a pip requirements file (comments and blank lines left out)."""
    from packaging.requirements import Requirement

    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) of a wheel, from its METADATA."""
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(name).decode())
    return meta["Name"], meta["Version"], meta.get_all("Requires-Dist") or []


def active(req, python_version: str | None) -> bool:
    """Whether a requirement applies (no extra asked for) on the target Python (default: this one)."""
    if req.marker is None:
        return True
    env = {"extra": ""}
    if python_version:
        env |= {"python_version": python_version, "python_full_version": python_version + ".0"}
    return req.marker.evaluate(env)


def wheels_in(dest: Path) -> dict:
    """name -> (version, requirements, file) of the wheels in `dest`; two versions of one name is an error."""
    from packaging.requirements import Requirement

    found = {}
    for path in sorted(dest.glob("*.whl")):
        name, version, reqs = wheel_metadata(path)
        if norm(name) in found:
            fail(f"{dest}: two wheels of {name} ({found[norm(name)][2].name}, {path.name}): pip's install there "
                 f"stops on that; remove the one not in {WHEELS.name}")
        found[norm(name)] = (version, [Requirement(r) for r in reqs], path)
    return found


def check_closure(found: dict, python_version: str, assumed: list | None = None) -> list[str]:
    """Every wheel's requirements met by a carried wheel or by the image's list: the problems, or []. A requirement
    on an image package whose version no reading gave is appended to `assumed` (the device's --check tests it)."""
    image = {norm(r.name): r for r in requirements(IMAGE)}
    problems = []
    for name, (version, reqs, path) in found.items():
        for req in (r for r in reqs if active(r, python_version)):
            dep = norm(req.name)
            if dep in found:
                have = found[dep][0]
            elif dep in image:
                pinned = [s.version for s in image[dep].specifier if s.operator == "=="]
                have = pinned[0] if pinned else None
                if have is None and req.specifier and assumed is not None:
                    assumed.append(f"{req} ({name})")
            else:
                problems.append(f"{path.name} needs {req}, neither carried nor in {IMAGE.name}: add it to {WHEELS.name}")
                continue
            if have is not None and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{path.name} needs {req}, and {dep} {have} is what the device would have")
    return problems


def travelling_bytes() -> int:
    """Bytes the device tool sends besides carried paths: tracked and untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, check=True).stdout
    files = {REPO / os.fsdecode(p) for p in out.split(b"\0") if p}
    if (REPO / "shared").is_dir():  # sent whole, ignored or not
        files |= set((REPO / "shared").rglob("*"))
    return sum(p.stat().st_size for p in files if p.is_file() and not p.is_symlink())


def download(dest: Path, python_version: str) -> None:
    pins = requirements(WHEELS)
    if any(len(r.specifier) != 1 or next(iter(r.specifier)).operator != "==" for r in pins):
        fail(f"{WHEELS}: pin every wheel with == (the device resolves nothing)")
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {norm(r.name): next(iter(r.specifier)).version for r in pins}
    stale = [p for p in dest.glob("*.whl") if (lambda m: wanted.get(norm(m[0])) != m[1])(wheel_metadata(p))]
    if stale:
        fail(f"{dest} holds wheels not pinned in {WHEELS.name}: {', '.join(p.name for p in stale)}; "
             f"remedy: rm -r {dest} and run this again")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation",
           "cp", "--python-version", python_version, *(f"--platform={p}" for p in PLATFORMS), "-d", str(dest),
           "-r", str(WHEELS)]
    if subprocess.run(cmd).returncode:
        fail(f"pip download failed (above): {' '.join(cmd)}")
    found = wheels_in(dest)
    missing = sorted(set(wanted) - set(found))
    if missing:
        fail(f"no wheel of {', '.join(missing)} in {dest}")
    assumed = []
    if problems := check_closure(found, python_version, assumed):
        fail("\n  ".join(["the carried wheels do not close over the image:", *problems]))
    if assumed:
        print(f"assumed of the image (no version read; checked there by --check): {', '.join(assumed)}")
    wheel_bytes = sum(p.stat().st_size for _, _, p in found.values())
    inside = dest.resolve().is_relative_to(REPO)
    tree = travelling_bytes() if inside else 0
    for (version, _, path) in sorted(found.values(), key=lambda v: v[2].name):
        print(f"  {path.stat().st_size / 2**20:7.2f} MiB  {path.name}")
    with_tree = (f"with the working tree that travels ({tree / 2**20:.2f} MiB)" if inside else
                 "outside the repository, the wheels alone")
    print(f"{len(found)} wheels for CPython {python_version}, {wheel_bytes / 2**20:.2f} MiB; {with_tree}: "
          f"{(wheel_bytes + tree) / 2**20:.2f} MiB of {LIMIT_MIB} MiB")
    if wheel_bytes + tree > LIMIT_MIB * 2**20:
        fail(f"over the device tool's {LIMIT_MIB} MiB: carry fewer wheels or move large untracked files out")


def package_versions() -> dict:
    """name -> version of the packages the GPU check imports (None: not installed), as this interpreter sees them."""
    from importlib import metadata

    out = {}
    for name in REPORTED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def check_installed(dest: Path) -> None:
    """Where the wheels are installed: each carried distribution is the one imported, its requirements met."""
    from importlib import metadata

    from packaging.requirements import Requirement

    problems = []
    for name, (version, _, path) in wheels_in(dest).items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} {version} ({path.name}) is not installed")
            continue
        if dist.version != version:
            problems.append(f"{name} {dist.version} is found first, not the carried {version}")
        for req in (Requirement(r) for r in dist.requires or []):
            if not active(req, None):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{name} needs {req}: not installed")
                continue
            if not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} needs {req}, {req.name} {have} is installed")
    print("versions: " + ", ".join(f"{k} {v or '-'}" for k, v in package_versions().items()), flush=True)
    if problems:
        fail("\n  ".join(["the carried wheels do not fit this environment:", *problems,
                          "remedy: pin versions that fit in bench/device-wheels.txt (and bench/device-image.txt), "
                          "then python3 bench/prepare_device.py again"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=DEST, help="the wheel folder (default: .whl in the repository)")
    ap.add_argument("--python-version", default="3.12", help="the device's CPython (default 3.12)")
    ap.add_argument("--check", action="store_true", help="check the installed wheels in this environment")
    a = ap.parse_args()
    if a.check:
        check_installed(a.dest)
    else:
        download(a.dest, a.python_version)


if __name__ == "__main__":
    main()
