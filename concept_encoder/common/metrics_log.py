"""The metrics log, `<run>/metrics.jsonl`: one JSON object per record, mirrored to W&B; torch-free, so the tools
that read runs (compare, curve) load it without the training stack."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from . import json_io
from .faults import raise_run_folder_gone

logger = logging.getLogger("concept_encoder")


class MetricsWriter:
    """Appends one JSON object per record to `<run>/metrics.jsonl` and mirrors it to W&B."""

    def __init__(self, path: Path, wandb_run=None):
        self.path = Path(path)
        self.wandb_run = wandb_run

    def drop_after(self, step: int) -> None:
        """Remove the records of steps after `step` (those a resume from `step` will write again)."""
        if self.path.exists():  # a line cut short by a crash is dropped here, with a warning naming it
            kept = [json_io.dumps(record) for record in read_metrics(self.path) if record["step"] <= step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if not self.path.parent.is_dir():
            raise_run_folder_gone(self.path.parent)
        with self.path.open("a") as f:
            f.write(json_io.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])


def read_metrics(path: Path) -> list[dict]:
    """The records of a `metrics.jsonl`; a line that does not parse (a write cut short by a crash or a full
    disk) is skipped with a warning naming the file and line, not a traceback."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or "step" not in record:
            logger.warning("%s line %d is not a metrics record (cut short?): skipped", path, number)
            continue
        records.append(record)
    return records
