"""The command-line frame both jobs share: errors as one paragraph and an exit code, quiet libraries, encoding options."""

from __future__ import annotations

import sys
import traceback

import click

from schemas.encoding import CHAT_TEMPLATE_MODES, TRUNCATION_MODES, EncodingConfig

EXIT_FAILED, EXIT_REFUSED = 1, 2


def run_cli(body, debug: bool) -> None:
    """Run a command body, turning the errors users can act on into one paragraph and exit code 2."""
    from schemas.format import CacheError
    from schemas.stamps import WeightsError

    from .data import DataError
    from .errors import JobError

    try:
        body()
    except (DataError, JobError, CacheError, WeightsError, click.UsageError) as e:
        if debug:
            traceback.print_exc()
        if isinstance(e, click.UsageError):
            raise
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_REFUSED)
    except KeyboardInterrupt:
        click.echo("interrupted; re-run the same command to resume", err=True)
        sys.exit(130)
    except Exception as e:
        if debug:
            traceback.print_exc()
        else:
            click.echo(f"error: unexpected {type(e).__name__}: {e} (re-run with --debug for the traceback)", err=True)
        sys.exit(EXIT_FAILED)


def quiet_libraries() -> None:
    """Our own progress bar and summary replace the libraries' per-file bars and notices."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def encoding_options(f):
    """Encoding options shared by every command that encodes data (defaults are the schema's)."""
    d = EncodingConfig()
    f = click.option("--chat-template", type=click.Choice(CHAT_TEMPLATE_MODES), default=None,
                     help=f"Apply the tokenizer's chat template: auto (conversational rows only), on, off. [default: {d.chat_template}]")(f)
    f = click.option("--truncation-mode", type=click.Choice(TRUNCATION_MODES), default=None,
                     help=f"Over-long pairs: keep_start cuts completion ends, keep_end cuts the prompt start, error "
                          f"rejects the row. [default: {d.truncation_mode}]")(f)
    f = click.option("--max-length", type=click.IntRange(min=2), default=None,
                     help=f"Maximum prompt + completion tokens per sequence. [default: {d.max_length}]")(f)
    return f


def encoding_from(max_length, truncation_mode, chat_template, base: EncodingConfig | None = None) -> EncodingConfig:
    base = base or EncodingConfig()
    given = {"max_length": max_length, "truncation_mode": truncation_mode, "chat_template": chat_template}
    return EncodingConfig(**{**base.to_dict(), **{k: v for k, v in given.items() if v is not None}})
