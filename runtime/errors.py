"""The refusal every command reports as one paragraph with exit code 2, and a training run that diverged (exit 3)."""


class JobError(RuntimeError):
    """A refusal the user can act on (exit code 2)."""


class NonFiniteError(JobError):
    """Training stopped because a loss, gradient norm or weight was not finite (NaN or infinite): exit code 3
    (runtime.cli.EXIT_NON_FINITE), so that a script can tell it from a refusal."""

    exit_code = 3
