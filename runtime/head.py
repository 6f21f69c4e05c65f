"""The head paths `logprobs.token_logps` can take to a model's output-head values and how close each must come to
the model's own `logits` (log_softmax) on a short unpadded sequence; `logprobs.verified_head` decides once per model.

The fast way (`hook`: output embeddings applied to the hidden states of the scored positions, in chunks) is only
right for models whose head is that projection and nothing more; some scale, soft-cap or otherwise post-process
the logits in their causal-LM forward, and some call an inner module the hook never sees. Nothing of a model's
head is re-implemented here: a model the projection does not reproduce gets its own logits instead, for the scored
positions only where it takes a boolean `logits_to_keep` mask (`logits_to_keep`), else all of them (`logits`).
"""

from __future__ import annotations



HEADS = ("hook", "logits_to_keep", "logits")
PROBE_TOKENS = 24


