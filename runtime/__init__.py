"""What both jobs share: data loading, log-probs, packing, checkpoints, the CLI frame."""
