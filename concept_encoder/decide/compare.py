"""Compare runs: what differs between them, their final metrics side by side, their curves.

    python -m concept_encoder compare Cache/runs/a Cache/runs/b Cache/runs/c
    make compare RUNS="Cache/runs/a Cache/runs/b"

Reads each run's `config.json`, `metrics.jsonl` and `summary.json` (pretraining runs of `loops/mlm.py`
and fine-tuning runs of `loops/finetune.py`; for a pretraining run also the fine-tuning reports in
`Cache/reports/` that name it) and prints (1) the resolved settings that differ (the
ablation axis) and how many are held fixed, (2) the final metrics side by side with deltas against the
first run, and gate outcomes; it writes `Cache/reports/compare_<time>.{md,json,png}`, the PNG overlaying
train loss, eval loss and effective rank against tokens seen. No torch: it reads files.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..common import json_io
from ..common.faults import DiskFullError, written_whole
from ..common.metrics_log import read_metrics
from ..common.paths import cache_path
from ..common.report_files import check_report_dir, claim_report_stem

# Settings that name or place a run, or describe the machine, rather than define the experiment.
NOT_SETTINGS = (
    "run_dir", "system.", "data_stats.", "parameters.", "training_args.run_name", "training_args.output_dir",
    "training_args.resume_from_checkpoint", "training_args.progress_bar", "training_args.report_to",
    "training_args.wandb_project", "model_config.auto_map.", "model_config.transformers_version",
    "model_config._name_or_path", "model_config.architectures", "finetune_args.model_name_or_path", "note",
    "training_args.allow_cpu",
)  # fmt: skip
LOWER_IS_BETTER = ("loss", "perplexity", "cosine", "collapsed", "seconds", "step_time")


@dataclass
class Run:
    path: Path
    config: dict
    summary: dict
    records: list[dict] = field(default_factory=list)
    unfinished: bool = False  # no summary.json yet (running, or crashed), or one a signal's stop wrote

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def label(self) -> str:
        """The run's column title: its name, marked when it has not finished (latest metrics shown) or when
        `--max_time` ended it before its last step (compared at fewer steps than the others)."""
        step = self.summary.get("step", self.summary.get("steps", "?"))
        if self.unfinished:
            return f"{self.name} (running / unfinished, step {step})"
        if (self.summary.get("max_time") or {}).get("stopped_by_max_time"):  # ended early, fewer steps than planned
            return f"{self.name} (stopped by --max_time at step {step})"
        return self.name

    def settings(self) -> dict:
        flat = flatten(self.config)
        kept = {k: v for k, v in flat.items() if not k.startswith(NOT_SETTINGS)}
        if "parameters.total" in flat:  # the size, not its breakdown by module
            kept["parameters.total"] = flat["parameters.total"]
        return kept

    def final_metrics(self) -> dict[str, float]:
        flat = flatten(self.summary)
        return {k: v for k, v in flat.items() if is_number(v) and not k.startswith(("baseline.", "run_dir"))}


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def flatten(mapping: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def load_run(path: str | Path) -> Run:
    """A run folder's files; ValueError naming the folder and what is missing otherwise."""
    path = Path(path)
    missing = [name for name in ("config.json", "metrics.jsonl") if not (path / name).is_file()]
    if not path.is_dir() or missing:
        what = "no such folder" if not path.is_dir() else f"no {' or '.join(missing)}"
        raise ValueError(
            f"{path} is not a run folder ({what}); pass folders written by loops/mlm.py or loops/finetune.py, "
            "e.g. Cache/runs/<run>"
        )
    records = read_metrics(path / "metrics.jsonl")  # a line cut short is named and skipped
    summary_path = path / "summary.json"
    summary = json_object(summary_path) if summary_path.is_file() else latest_metrics(records)
    unfinished = not summary_path.is_file() or bool(summary.get("preempted"))  # a signal stopped it at a checkpoint
    return Run(path, json_object(path / "config.json"), summary, records, unfinished)


def json_object(path: Path) -> dict:
    """The JSON object in `path`; ValueError naming the file when it is not JSON or not an object."""
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not JSON ({error}); is this a run folder written by this project?") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object; is this a run folder?")
    return value


def latest_metrics(records: list[dict]) -> dict:
    """A run still going (or stopped without a summary): its newest value of every logged metric, and its step."""
    latest: dict = {}
    for record in records:
        latest.update({k: v for k, v in record.items() if k != "kind"})
    return latest


def add_finetune_reports(runs: list[Run], report_dir: Path) -> None:
    """Put each pretraining run's fine-tuning scores (from `loops/finetune.py` reports naming it, newest
    last) into its final metrics as `finetune/<task>/<metric>` (mean over seeds), its probes' as
    `probe/<features>/<task>/<metric>`."""
    for path in sorted(Path(report_dir).glob("finetune_*.json")):
        for row in json.loads(path.read_text()).get("rows", []):
            for run in runs:
                if row.get("model") == run.name:
                    method = row.get("method", "fine-tune")  # probes: probe/<features>/...
                    prefix = "finetune" if method == "fine-tune" else method.replace(": ", "/").replace(" ", "_")
                    for metric in row.get("metrics", []):
                        run.summary[f"{prefix}/{row['task']}/{metric}"] = row[f"{metric}_mean"]


def add_heldout_checks(runs: list[Run]) -> None:
    """Put each run's held-out language checks (`<run>/heldout-<name>.json`, written by `ablate --heldout`)
    into its final metrics as `heldout/<name>/<metric>`."""
    for run in runs:
        for path in sorted(run.path.glob("heldout-*.json")):
            record = json.loads(path.read_text())
            name = path.stem.removeprefix("heldout-")
            run.summary.update({f"heldout/{name}/{k}": v for k, v in record.items() if is_number(v)})


def differences(runs: list[Run]) -> tuple[dict[str, list], list[str]]:
    """({setting: [value per run]} for the settings that differ, [the settings held fixed])."""
    settings = [run.settings() for run in runs]
    keys = sorted(set().union(*settings))
    differ = {k: [s.get(k) for s in settings] for k in keys if len({json.dumps(s.get(k)) for s in settings}) > 1}
    return differ, [k for k in keys if k not in differ]


def lower_is_better(metric: str) -> bool:
    return any(word in metric for word in LOWER_IS_BETTER)


def metric_table(runs: list[Run]) -> dict[str, list]:
    """{metric: [value per run]} over the metrics every run's summary has."""
    finals = [run.final_metrics() for run in runs]
    shared = [k for k in finals[0] if all(k in f for f in finals[1:])]
    return {k: [f[k] for f in finals] for k in shared}


def tokens_at(run: Run, step: int) -> float:
    """Tokens seen at `step` (from the train records; steps carry equal token counts in packed runs)."""
    train = [r for r in run.records if r.get("kind") == "train" and "tokens_seen" in r]
    if not train:
        return float(step)
    last = train[-1]
    return step * last["tokens_seen"] / max(last["step"], 1)


def plot(runs: list[Run], out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("train loss", "train", "loss"), ("eval loss", "eval", "eval_loss"),
              ("effective rank fraction", "eval", "health/effective_rank_fraction")]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    drawn = False
    for ax, (title, kind, key) in zip(axes, panels, strict=True):
        for run in runs:
            points = [(tokens_at(run, r["step"]), r[key]) for r in run.records if r.get("kind") == kind and key in r]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o" if kind == "eval" else None, label=run.name)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("tokens seen")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    if drawn:
        fig.savefig(out, dpi=110)
    plt.close(fig)
    return out if drawn else None


def fmt(value) -> str:
    if is_number(value):
        return f"{value:.4g}" if isinstance(value, float) else f"{value:,}"
    return "-" if value is None else str(value)


def compare(paths: list[str | Path], report_dir: str | Path = "Cache/reports") -> dict:
    """Compare the runs at `paths`; writes the report files and returns what they hold."""
    runs = [load_run(p) for p in paths]
    add_finetune_reports(runs, cache_path(report_dir))
    add_heldout_checks(runs)
    differ, fixed = differences(runs)
    metrics = metric_table(runs)
    gates = [run.summary.get("gates", []) for run in runs]
    names = [run.label for run in runs]
    lines = [f"# Comparison of {len(runs)} runs", "", "## What differs", ""]
    if differ:
        lines += ["| setting | " + " | ".join(names) + " |", "|---|" + "---|" * len(runs)]
        lines += [f"| {k} | " + " | ".join(fmt(v) for v in values) + " |" for k, values in differ.items()]
    else:
        lines.append("Nothing: the runs share every setting.")
    lines += ["", f"Held fixed: {len(fixed)} settings.", "", "## Final metrics (Δ against the first run)", ""]
    lines += ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(runs)]
    for key, values in metrics.items():
        cells = [fmt(values[0])]
        for value in values[1:]:
            delta = value - values[0]
            cells.append(f"{fmt(value)} ({'+' if delta >= 0 else ''}{delta:.3g})")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    if any(gates):
        lines += ["", "## Gates", ""]
        for name, outcomes in zip(names, gates, strict=True):
            for o in outcomes:
                verdict = {True: "passed", False: "FAILED", None: "not reached"}[o["passed"]]
                lines.append(
                    f"- {name}: `{o['gate']}` {verdict}"
                    + (f" ({fmt(o['value'])} at step {o['step']})" if o["step"] is not None else "")
                )
    stem = Path(claim_report_stem(report_dir, "compare"))  # compare_<time>[_NN]: this invocation's own
    with written_whole([stem.with_suffix(s) for s in (".md", ".json", ".png")], f"the report {stem.name}.*"):
        png = plot(runs, stem.with_suffix(".png"))
        if png:
            lines += ["", f"![curves]({png.name})"]
        result = {"runs": [str(r.path) for r in runs], "differs": differ, "fixed": fixed, "metrics": metrics,
                  "gates": dict(zip(names, gates, strict=True)), "markdown": str(stem.with_suffix(".md")),
                  "png": str(png) if png else None}  # fmt: skip
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
        stem.with_suffix(".json").write_text(json_io.dumps(result, indent=2, default=str))
    result["text"] = "\n".join(lines)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m concept_encoder compare",
        description="What differs between runs, their final metrics side by side (Δ against the first), their curves.",
    )
    parser.add_argument("runs", nargs="+", help="run folders (Cache/runs/<run> or Cache/finetune/<run>)")
    parser.add_argument("--report_dir", default="Cache/reports", help="where compare_<time>.{md,json,png} go")
    args = parser.parse_args(argv)
    try:
        check_report_dir(args.report_dir, "--report_dir")
        result = compare(args.runs, args.report_dir)
    except (ValueError, DiskFullError) as error:
        parser.exit(2, f"error: {error}\n")
    print(result["text"])
    print(f"\nwrote {result['markdown']}, its .json{' and .png' if result['png'] else ''}")
    return 0


if __name__ == "__main__":
    from ..common.entry import run_tool

    sys.exit(run_tool(main, "python -m concept_encoder compare"))
