"""The remedies that bring a cache to its data or pick one of its versions, in one vocabulary: precompute-ref
--update (rows the cache lacks), --update --replace-changed (rows edited under an id the cache holds), --cache-version
N (rows a later version removed, or a resume whose rows a later version changed), an update's own settings, and a
damaged cache's rebuild command (schemas/findings.py `rebuild`, which the contract's own refusals use too). Every
refusal that is answered by one of these takes its words from here (precompute/update.py, dpo/verify.py,
dpo/provenance.py), so none still says "re-run precompute-ref into a fresh --out" where an update or a version does
it."""

from __future__ import annotations

from schemas.findings import damaged, rebuild, split_words  # noqa: F401  a damaged cache: the command that makes it again
from schemas.history import VERSION_OPTION  # train-dpo's and audit-ref's option naming a version
from storage.quoting import shell_word

KEEPS_VERSIONS = "earlier runs keep their version: audit-ref --run finds it"

# precompute-ref's: a --out that holds another cache, and an --update given another model, tokenizer or device
OVERWRITE = "use --overwrite to replace it, or choose another --out"
UPDATE = ("to bring it to this data (keeping its rows, scoring only new ones, with the same model and settings) pass "
          "--update; else " + OVERWRITE)
NEW_CACHE = ("an update scores new rows exactly as the cache's were scored: make a new cache for this model, tokenizer, "
             "encoding or device with another --out (precompute-ref without --update)")


def update_command(cache, data, model, *, replace_changed: bool = False, split: str | None = None) -> str:
    """The precompute-ref --update command that brings `cache` to `data` (the cache's settings are its own)."""
    return (f"precompute-ref --model {shell_word(model)} --data {shell_word(data)}{split_words(split)} --out {shell_word(cache)} "
            "--update"
            + (" --replace-changed" if replace_changed else ""))


def rows_missing(cache, data, model, split: str | None = None) -> str:
    """Data rows the cache does not hold."""
    return (f"bring the cache to this data with `{update_command(cache, data, model, split=split)}` (it scores only "
            f"the rows the cache lacks; {KEEPS_VERSIONS}), or train on rows the cache holds")


def rows_changed(cache, data, model, split: str | None = None) -> str:
    """Data rows whose content changed under an id the cache holds."""
    command = update_command(cache, data, model, replace_changed=True, split=split)
    return (f"bring the cache to the edited rows with `{command}` (it scores them again and replaces them; "
            f"{KEEPS_VERSIONS}), or train on the data the cache was made from")


def rows_removed(versions: list[int], holding: int | None) -> str:
    """Data rows that an update of the cache removed (`versions`: the versions that removed them; `holding`: the
    newest version kept that holds them all)."""
    which = ", ".join(map(str, versions))
    if holding is None:
        return (f"version{'s' if len(versions) > 1 else ''} {which} of the cache removed them (precompute-ref "
                "--update), and no version kept holds them all: train on the rows the cache holds")
    return (f"version{'s' if len(versions) > 1 else ''} {which} of the cache removed them (precompute-ref --update): "
            f"pass {VERSION_OPTION} {holding} to train on version {holding}, which holds them")


def rows_replaced(versions: list[int], holding: int) -> str:
    """Data rows as they were before an update of the cache replaced them (`holding`: the newest version kept that
    holds them as the data has them)."""
    which = ", ".join(map(str, versions))
    return (f"version{'s' if len(versions) > 1 else ''} {which} of the cache replaced them (precompute-ref --update "
            f"--replace-changed): pass {VERSION_OPTION} {holding} to train on version {holding}, which holds them as "
            "this data has them")


def eval_cache(model, data, split: str, *, shared: bool = False, top_k: int | None = None) -> str:
    """Eval rows that need a cache of their own (`shared`: the cache given for them is the training rows' cache;
    `top_k`: the training cache's --top-k, which the eval cache needs for the evaluations to log the KL figures)."""
    why = ("the eval rows need a cache of their own (an --update of this one to the eval data would drop the training "
           "rows): " if shared else "")
    return (f"{why}make one with `precompute-ref --model {shell_word(model)} --data {shell_word(data)}{split_words(split)}"
            + (f" --top-k {int(top_k)}" if top_k else "") + " --out EVAL_CACHE`, then pass --eval-ref-cache EVAL_CACHE")


def rows_in_current(version: int, current: int, resuming: bool = False) -> str:
    """Data rows that an earlier version (`version`, --cache-version) holds otherwise, and the current one as the
    data has them: the update was made already (`resuming`: a checkpoint trained on `version` is resumed)."""
    held = (f"version {current}, the cache's current one, holds them as this data has them (an update replaced them "
            f"since version {version})")
    if resuming:
        return (f"{held}: this checkpoint trained on version {version} resumes with the data it trained on; train on "
                "this data in a new run (a fresh --output-dir)")
    return f"{held}: leave out {VERSION_OPTION} to train on it"


def setting(options: list[str], *, update: bool = True) -> str:
    """A run into a cache (--update, or a resume) given a setting the cache was made without."""
    run = "--update" if update else "a resume"
    return (f"pass {' '.join(options)} (the cache's own), or leave the option out: {run} takes every setting from "
            "the cache and scores new rows exactly as the cache's were" + ("" if update else
                                                                             "; or pass --overwrite to start over"))


# TRL's DPOTrainer knows neither the data's file nor the reference's folder: its remedies name them as placeholders
TRL_DATA, TRL_MODEL = "<this dataset>", "<the reference model>"


def trl_rows(cache) -> dict:
    """The row remedies for dpo/trl.py's DPOTrainer against `cache` (schemas/rules.py row_findings' kinds)."""
    return {"rows_missing": rows_missing(cache, TRL_DATA, TRL_MODEL),
            "mask_checksum": rows_changed(cache, TRL_DATA, TRL_MODEL)}


def resume_moved(old: int, new: int, other_data: bool = False) -> str:
    """A resume whose rows a later (or earlier) version of the cache changed; `other_data`: this run's data is not
    the data the checkpoint trained on (edited since), which version `old` does not hold."""
    if other_data:
        return (f"this run's data is not the data this checkpoint trained on (rows added, removed or edited since; "
                f"version {new} holds it as it is now): resume with the data it trained on and {VERSION_OPTION} {old}, or train on this data in "
                "a new run (a fresh --output-dir)")
    return (f"pass {VERSION_OPTION} {old} to keep training on version {old}, the one this checkpoint was trained on, "
            "or start a new run (a fresh --output-dir)")
