"""The reader of a run's metrics.jsonl (dpo/trainer.py's MetricsFile writes it): apart from the trainer, so that
the model card and the run summary read it without importing torch and transformers."""

from __future__ import annotations

import json
from pathlib import Path


def metrics_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, in file order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
