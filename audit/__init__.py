"""audit-ref: re-verify a cache or a finished run, and replay the reference on a sample."""
