# Batching modes of precompute-ref, described in modes.py (here so the CLI can list them without importing torch).
MODES = ("full_forward", "varlen", "kv_cache", "shared_prompt", "packed", "single")
