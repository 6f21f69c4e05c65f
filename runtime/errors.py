"""The refusal every command reports as one paragraph with exit code 2."""


class JobError(RuntimeError):
    """A refusal the user can act on (exit code 2)."""
