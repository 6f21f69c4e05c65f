"""What the three commands share (precompute-ref, train-dpo, audit-ref): data loading, log-probs, packing, checkpoints, the CLI frame."""
