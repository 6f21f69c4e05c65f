from .modes import MODES  # noqa: F401  (the batching modes' names, from their registry in precompute/modes/)
