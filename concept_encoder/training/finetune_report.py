"""The fine-tuning report: one row per (model, task), metrics as mean ± std over seeds with each seed's
value, the trivial baseline on the same split beside them; markdown, JSON and a grouped bar chart."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single seed)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def report_rows(results: list[dict]) -> list[dict]:
    """`results`: one dict per fine-tuning run (model, task, seed, validation metrics, baseline, best step,
    seconds). Returns one row per (model, task) with `<metric>_mean`, `<metric>_std`, `<metric>_seeds`."""
    rows: dict[tuple[str, str], dict] = {}
    for result in results:
        row = rows.setdefault(
            (result["model"], result["task"]),
            {"model": result["model"], "task": result["task"], "metrics": list(result["validation"]), "runs": []},
        )
        row["runs"].append(result)
    for row in rows.values():
        runs = row.pop("runs")
        row["seeds"] = [r["seed"] for r in runs]
        for metric in row["metrics"]:
            values = [r["validation"][metric] for r in runs]
            row[f"{metric}_mean"], row[f"{metric}_std"] = mean_std(values)
            row[f"{metric}_seeds"] = values
        row["baseline"] = runs[0]["baseline"]
        row["best_steps"] = [r["best_step"] for r in runs]
        row["seconds"] = round(sum(r["seconds"] for r in runs), 1)
    return list(rows.values())


def format_markdown(rows: list[dict], title: str) -> str:
    lines = [title, ""]
    for task in dict.fromkeys(row["task"] for row in rows):
        task_rows = [row for row in rows if row["task"] == task]
        metrics = task_rows[0]["metrics"]
        lines += [
            f"Task `{task}` (validation split; the step chosen on the dev split):",
            "",
            "| model | "
            + " | ".join(f"{m} (mean ± std)" for m in metrics)
            + f" | {metrics[0]} per seed | steps chosen | time (s) |",
            "|---|" + "---|" * (len(metrics) + 3),
        ]
        for row in task_rows:
            cells = [f"{row[f'{m}_mean']:.4f} ± {row[f'{m}_std']:.4f}" for m in metrics]
            seeds = ", ".join(f"{v:.4f}" for v in row[f"{metrics[0]}_seeds"])
            lines.append(
                f"| {row['model']} | " + " | ".join(cells) + f" | {seeds} | {row['best_steps']} | {row['seconds']} |"
            )
        baseline = task_rows[0]["baseline"]
        lines.append(
            "| trivial baseline (majority class / mean) | "
            + " | ".join(f"{baseline[m]:.4f}" for m in metrics)
            + " | | | |"
        )
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Grouped bars of the main metric per task: one bar per model with its std as error bar, plus the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(row["task"] for row in rows))
    models = list(dict.fromkeys(row["model"] for row in rows)) + ["baseline"]
    width = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(max(6, 2.5 * len(tasks) * len(models) / 2), 4.5))
    for i, model in enumerate(models):
        means, stds = [], []
        for task in tasks:
            row = next(r for r in rows if r["task"] == task and (model == "baseline" or r["model"] == model))
            main = row["metrics"][0]
            means.append(row["baseline"][main] if model == "baseline" else row[f"{main}_mean"])
            stds.append(0.0 if model == "baseline" else row[f"{main}_std"])
        ax.bar([t + i * width for t in range(len(tasks))], means, width, yerr=stds, capsize=4, label=model)
    ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], [f"{t}\n({rows[0]['metrics'][0]})" for t in tasks])
    ax.set_ylabel("validation metric (mean ± std over seeds)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: list[dict], out_dir: Path, stamp: str, title: str) -> dict[str, Path]:
    """`finetune_<stamp>.{md,json,png}` under `out_dir`; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = report_rows(results)
    paths = {ext: out_dir / f"finetune_{stamp}.{ext}" for ext in ("md", "json", "png")}
    paths["md"].write_text(format_markdown(rows, title) + "\n")
    paths["json"].write_text(json.dumps({"title": title, "rows": rows, "runs": results}, indent=2, default=str))
    plot(rows, paths["png"])
    return paths
