"""Models and data sets named by hub id (`org/name`), resolved through the local Hugging Face cache as transformers
and datasets do. Nothing is downloaded here: a missing one is an error saying how to download it."""

from __future__ import annotations

from pathlib import Path

from storage.nearby import missing

from .errors import JobError


def _looks_like_repo_id(name: str) -> bool:
    parts = str(name).split("/")
    return len(parts) == 2 and all(parts) and not str(name).startswith((".", "~"))


def resolve(name: str, repo_type: str) -> str:
    """`name` itself when it is a local path; else the snapshot folder of hub repo `name` in the local HF cache."""
    name = str(name)  # a command line's location (runtime.locations.Location): a hub id reads as a relative path
    if Path(name).exists() or not _looks_like_repo_id(name):
        return str(name)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id=name, repo_type=repo_type, local_files_only=True)
    except Exception:  # huggingface_hub raises LocalEntryNotFoundError (and friends) for anything not cached
        if Path(name).parent.is_dir() and Path(name).parent != Path("."):  # a local path mistyped, not a hub id
            raise JobError(missing(name)) from None
        flag = " --repo-type dataset" if repo_type == "dataset" else ""
        raise JobError(f"{name}: no such local path, and the {repo_type} {name} was not found locally in the Hugging "
                       f"Face cache; download with `hf download {name}{flag}` (or pass a local folder)") from None


def resolve_model(name: str | None) -> str | None:
    return None if name is None else resolve(name, "model")


def resolve_data(name: str | None) -> str | None:
    return None if name is None else resolve(name, "dataset")


def origin(name: str, repo_type: str) -> dict:
    """Where a model or data set comes from, for the manifests and cards: {"path": the local path}, and for a hub id
    also {"hub_id": the id as given, "revision": the snapshot's commit (its folder's name in the HF cache)}."""
    from schemas.run_manifest import absolute

    path = resolve(name, repo_type)
    if path == str(name):
        return {"path": absolute(path)}
    return {"path": path, "hub_id": str(name), "revision": Path(path).name}


def hub_path_type(repo_type: str, *, folder: bool = True):
    """A click type for an option that takes a local path or a hub id (`org/name`), as --model and --data do: the
    value is `resolve`d (a hub id to its snapshot folder in the local HF cache, offline) and must then exist (a
    folder where `folder`). An id not in the cache is a usage error saying how to download it."""
    import click

    class HubPath(click.Path):
        names_misses = True  # a path that is not there is named with what is near it (not_here), here

        def __init__(self):
            super().__init__(exists=True, file_okay=not folder)

        def convert(self, value, param, ctx):
            try:
                value = resolve(value, repo_type) if isinstance(value, str) else value
            except JobError as e:
                self.fail(str(e), param, ctx)
            try:
                return super().convert(value, param, ctx)
            except click.BadParameter:
                if Path(value).exists() or Path(value).is_symlink():
                    raise
                self.fail(missing(value), param, ctx)

    return HubPath()
