"""The command-line frame the three commands share (precompute-ref, train-dpo, audit-ref): errors as one paragraph and
an exit code, the process's end, quiet libraries, the command line as parsed (Command, GroupedCommand) and as given
back (command_text). The options themselves: runtime/options.py; path-or-URL options: runtime/locations.py."""

from __future__ import annotations

import errno
import itertools
import os
import sys
import traceback

import click

from storage.quoting import shell_word

from .signals import EXIT_INTERRUPTED, Terminated, terminate_as_interrupt

# Every command's exit codes: 0 done (audit-ref: every check passed), 1 failed (a check failed, an unexpected error),
# 2 refused (bad input, a cache or output folder that does not match, a usage error), 3 (train-dpo) stopped because
# the loss, the gradient norm or the weights became non-finite (runtime.errors.NonFiniteError), 130 interrupted
# (Ctrl-C), 143 terminated (SIGTERM), as a shell reports a process those signals end.
EXIT_OK, EXIT_FAILED, EXIT_REFUSED, EXIT_NON_FINITE = 0, 1, 2, 3  # 130 and 143: runtime/signals.py


def run_cli(body, debug: bool, next_step=None, writes_to=None) -> None:
    """Run a command body, turning the errors users can act on into one paragraph and exit code 2. `next_step`: the
    command's own advice after an interruption or a full disk, `() -> str` (default: precompute-ref's, where the same
    command resumes); `writes_to`: `() -> folder or None`, where the command writes (named when the disk is full)."""
    from storage.files import UnsafeDestination
    from schemas.format import CacheError
    from schemas.stamps import WeightsError
    from storage.faults import StoreUnavailable

    from .data import DataError
    from .disk import NoSpaceError, is_no_space, no_space_error
    from .errors import JobError
    from .terminal import clipped, echo, printable

    def carry_on() -> str:
        if next_step is None:
            return "re-run the same command to resume"
        try:
            return next_step()
        except Exception as e:  # the advice must not hide what happened
            return f"(no advice: {type(e).__name__}: {e})"

    try:
        try:
            with terminate_as_interrupt():
                body()
        except (DataError, JobError, CacheError, WeightsError, UnsafeDestination, StoreUnavailable, click.UsageError,
                KeyboardInterrupt):
            raise
        except Exception as e:
            folder = _writes_to(writes_to)
            if not is_no_space(e, folder):
                raise
            raise no_space_error(e, folder) from e  # a save no one wrapped in runtime.disk.writing
    except (DataError, JobError, CacheError, WeightsError, UnsafeDestination, StoreUnavailable, click.UsageError) as e:
        if debug:
            traceback.print_exc()
        if isinstance(e, click.UsageError):  # click prints it: its text through the same rule
            e.message = printable(clipped(e.message))
            raise
        # messages are built in many places from data (ids, row text, paths, keys): the whole text is made
        # printable here (runtime/terminal.py), keeping only the newlines the message lays out
        echo(clipped(f"error: {e}" + (f"\n  then: {carry_on()}" if isinstance(e, NoSpaceError) else "")), err=True)
        sys.exit(getattr(e, "exit_code", EXIT_REFUSED))  # NonFiniteError: EXIT_NON_FINITE; KLAlarmStop: EXIT_KL_ALARM
    except KeyboardInterrupt as e:
        echo(f"{'terminated (SIGTERM)' if isinstance(e, Terminated) else 'interrupted'}; {carry_on()}", err=True)
        sys.exit(getattr(e, "exit_code", EXIT_INTERRUPTED))
    except ImportError as e:  # an option that needs a package this environment lacks (--use-liger-kernel, ...)
        if debug:
            traceback.print_exc()
        echo(printable(f"error: a package this run needs is not installed: {e}\n  remedy: install it in this "
                       "environment (pip install ...), or leave out the option that asks for it"), err=True)
        sys.exit(EXIT_REFUSED)
    except Exception as e:
        if debug:
            traceback.print_exc()
        if isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG:  # a path given that no file system takes
            echo(clipped(f"error: a path is too long for the file system: {e.filename}\n  remedy: give a shorter path "
                         "(at most 255 characters a name)"), err=True)
            sys.exit(EXIT_REFUSED)
        if not debug:
            echo(clipped(f"error: unexpected {type(e).__name__}: {e} (re-run with --debug for the traceback)"), err=True)
        sys.exit(EXIT_FAILED)


def _writes_to(writes_to):
    """The folder a command writes to, or None (not known, or its advice failed: the error at hand matters more)."""
    try:
        return writes_to() if writes_to else None
    except Exception:
        return None


def exit_without_teardown(command) -> None:
    """Run a click command as the whole process, then leave without the interpreter's module teardown (about 1-2 s
    of CPU after torch, transformers and datasets are imported, in every run). Everything that would run at a normal
    exit and can matter still runs first: the atexit handlers (logging, trackers, temp files), a garbage collection
    (finalizers of unreachable objects) and the flush of stdout and stderr. Full garbage collections wait until the
    command says its long-lived objects are made (`heap_settled`). Only for a process's entry point: in any other
    caller (a test's CliRunner, a notebook) call the command itself."""
    import atexit
    import gc

    _postpone_full_collections()
    try:
        command()  # click's standalone mode ends with SystemExit
        code = 0
    except SystemExit as e:
        code = e.code
    if isinstance(code, str):  # SystemExit("message"): printed to stderr, exit status 1
        from .terminal import echo

        echo(code, err=True)
        code = 1
    code = 0 if code is None else code
    atexit._run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing left to write
            pass
    os._exit(code)


# The thresholds of the garbage collector while a process's start-up postpones its full collections (None: not
# postponed, e.g. a test calling a command in its own process).
_POSTPONED: dict = {"thresholds": None}


def _postpone_full_collections() -> None:
    """Importing torch, transformers and datasets makes about half a million objects that live as long as the process
    and almost no garbage; each full collection on the way walks all of them again (8 in a train-dpo run, with the
    one at exit 0.9 s of CPU on a busy 2-core machine, finding a few hundred garbage objects). The young generations
    are still collected as usual: that is where the garbage is."""
    import gc

    _POSTPONED["thresholds"] = gc.get_threshold()
    young, middle, _old = _POSTPONED["thresholds"]
    gc.set_threshold(young, middle, 2**31 - 1)


def heap_settled() -> None:
    """Called by a command once its libraries are imported and its long-lived objects made (the model loaded, the
    Trainer built): the young generations are collected, what is alive then is moved out of the collector's reach
    (gc.freeze) and full collections resume at the usual thresholds, over the objects made from then on (so they,
    and the collection at exit, walk tens of thousands of objects instead of half a million). Cyclic garbage already
    in the old generation then (a few hundred objects in a train-dpo run), and frozen objects that become unreachable
    later, are not collected before the process ends. A no-op unless the process runs the command through
    exit_without_teardown."""
    import gc

    thresholds = _POSTPONED["thresholds"]
    if thresholds is None:
        return
    _POSTPONED["thresholds"] = None
    gc.collect(1)
    gc.freeze()
    gc.set_threshold(*thresholds)


def quiet_libraries(datasets: bool = True) -> None:
    """Our own progress bar and summary replace the libraries' per-file bars and notices. `datasets=False`: a command
    that reads no data (audit-ref --show --run) leaves that library unimported (over half a second)."""
    import logging

    import transformers

    if datasets:
        import datasets as library

        library.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)  # --device-map: precompute-ref prints the layout itself


# the words transformers' HfArgumentParser takes after a boolean option (its string_to_bool), case-insensitive
TRUE_WORDS, FALSE_WORDS = frozenset({"true", "t", "yes", "y", "1"}), frozenset({"false", "f", "no", "n", "0"})


WORD_LISTS = frozenset({"lora_target_modules", "report_to"})


def bool_words(params, args: list[str]) -> list[str]:
    """The command line with each boolean option's true/false word folded into the option, as TRL's scripts and docs
    write them for transformers' HfArgumentParser (`--bf16 True`, `--disable-tqdm=false`, `--gradient_checkpointing
    True`): `--x true` is `--x`, `--x false` is `--no-x` (a flag without a --no- form: not given). Every boolean option
    of every command (Command.parse_args); anything after `--` is left as it is. The same pass reads the value of
    an option that takes one as that option's (never folded), refuses one of the command's own options in its place
    (`--split --debug`), and joins the several words TRL's list form gives a WORD_LISTS option with commas."""
    opposite: dict[str, str | None] = {}
    for p in params:
        if isinstance(p, click.Option) and p.is_flag and p.is_bool_flag:
            for on in p.opts:
                opposite[on] = p.secondary_opts[0] if p.secondary_opts else None
            for off in p.secondary_opts:
                opposite[off] = p.opts[0]
    # the value of an option that takes one is that option's, whatever it reads like (`--out --overwrite false`:
    # --out's value is refused by its type, never turned into --no-overwrite)
    takes_value = {o for p in params if isinstance(p, click.Option) and not p.is_flag for o in p.opts}
    names = {o for p in params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}
    # options whose value is a comma-separated list, that TRL's HfArgumentParser takes as several words
    word_lists = {o for p in params if isinstance(p, click.Option) and p.name in WORD_LISTS for o in p.opts}
    # where the command takes no positional argument, any word after a boolean option is meant as its value
    positional = any(isinstance(p, click.Argument) for p in params)
    configs = [w for w in itertools.takewhile(lambda w: w != "--", args) if w.partition("=")[0] == "--config"]
    if len(configs) > 1:  # a second file would silently replace the first, whole
        raise click.UsageError("--config is given twice: give one file (put the options of both in it, or give the "
                               "other file's options on the command line)")
    out, i = [], 0
    while i < len(args):
        word = args[i]
        if word == "--":
            return out + args[i:]
        if word in takes_value:
            value = args[i + 1] if i + 1 < len(args) else None
            if value in names:  # `--split --debug`: the option was given no value
                raise click.UsageError(f"{word} needs a value: {value} is an option (give {word} its value first)")
            out += args[i:i + 2]
            i += 2
            if word in word_lists and not positional:  # TRL's list form: --lora_target_modules q_proj v_proj
                more = list(itertools.takewhile(lambda w: not w.startswith("-"), args[i:]))
                if more:
                    out[-1] = ",".join([out[-1], *more])
                    i += len(more)
            continue
        flag, eq, value = word.partition("=")
        following = args[i + 1] if i + 1 < len(args) else None
        if flag in opposite and (eq or (following is not None and (following.lower() in TRUE_WORDS | FALSE_WORDS or
                                                                    not (positional or following.startswith("-"))))):
            value = value if eq else args[i + 1]
            if value.lower() not in TRUE_WORDS | FALSE_WORDS:
                raise click.UsageError(f"{flag}{eq or ' '}{value}: a boolean option takes true or false (or no "
                                       "value)")
            i += 1 if eq else 2
            chosen = flag if value.lower() in TRUE_WORDS else opposite[flag]
            out += [chosen] if chosen else []
            continue
        out.append(word)
        i += 1
    return out


# ctx.meta's key of {option's name: the spelling the command line used} (typed_spellings)
TYPED = "refcache.typed"


def typed_spellings(params, args: list[str]) -> dict[str, str]:
    """{option name: the spelling the command line used for it} (`--dataset_name` for --data, the last one given, as
    click takes the last value), so that a refusal names the option as the user typed it (runtime.locations.named)."""
    spelling = {o: p.name for p in params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}
    typed = {}
    for word in itertools.takewhile(lambda w: w != "--", args):
        flag = word.partition("=")[0]
        if flag in spelling:
            typed[spelling[flag]] = flag
    return typed


def typed_options() -> dict[str, str]:
    """The spellings the running command's command line used (typed_spellings); {} outside a click command."""
    ctx = click.get_current_context(silent=True)
    return dict(ctx.meta.get(TYPED) or {}) if ctx is not None else {}


class Command(click.Command):
    """Every command's parser: a boolean option may be followed by a true/false word (bool_words), and command-line
    errors (click's own, raised while the options are parsed: a value that is not a choice, a path that does not
    exist) print their text by the terminal rule too (runtime/terminal.py). `elsewhere`: {option: what to give
    instead} for options another tool (TRL, transformers, the other command) has and this command does not, said
    after click's "No such option" (keys in kebab case; TRL's snake case is matched too)."""

    def __init__(self, *args, elsewhere: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.elsewhere = elsewhere or {}

    def parse_args(self, ctx, args):
        from .terminal import printable

        try:
            words = bool_words(self.get_params(ctx), list(args))
            ctx.meta[TYPED] = typed_spellings(self.get_params(ctx), words)
            return super().parse_args(ctx, words)
        except click.NoSuchOption as e:
            hint = self.elsewhere.get(e.option_name.split("=", 1)[0].replace("_", "-"))
            if hint:  # in place of click's guess by spelling (--warmup_ratio: "Did you mean --warmup-steps")
                e.message, e.possibilities = f"{e.message.rstrip('.')}; {hint}", None
            e.message = printable(e.message)
            raise
        except click.UsageError as e:
            e.message = printable(e.message)
            raise


class GroupedCommand(Command):
    """--help lists options under their group's heading, groups in the order they first appear."""

    def format_options(self, ctx, formatter):
        groups: dict[str, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record:
                groups.setdefault(getattr(param, "group", None) or "Other", []).append(record)
        groups["Other"] = groups.pop("Other", [])  # --config, --debug, --help last
        for name, records in groups.items():
            with formatter.section(f"{name} options"):
                formatter.write_dl(records)


def command_text(prog: str, values: dict, leading: tuple = ()) -> str:
    """The command line that gives these option values (click's names; None: not given), as a shell would take it:
    a boolean as --x / --no-x, a repeated option once per value, a whole number given to a float option as 50."""
    words = [prog, *map(str, leading)]
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{flag[2:]}")
        else:
            words += [w for v in (value if isinstance(value, list) else [value]) for w in (flag, number_text(v))]
    return " ".join(shell_word(w) for w in words)


def number_text(value) -> str:
    """A value as the user would type it: a whole number given to a float option (TrainingArguments' save_steps,
    logging_steps, ...) as an integer, 50 and not 50.0."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


def given_values(values: dict) -> dict:
    """The options actually given (None and empty repeatable options are 'not given')."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if v is not None and v != ()}
