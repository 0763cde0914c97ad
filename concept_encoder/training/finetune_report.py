"""The fine-tuning report: one row per (model, method, task), metrics as mean ± std over seeds with each
seed's value and how every choice was made on dev (learning rate and step, or the probe's C), beside the
task's baselines (majority class / mean, TF-IDF + linear); markdown, JSON and a grouped bar chart."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

STILL_IMPROVING = "still improving: train longer"


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single seed)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def report_rows(results: list[dict]) -> list[dict]:
    """`results`: one dict per run (model, method, task, seed, validation metrics, and for fine-tuning the
    chosen rate, rate grid, best step, still_improving, train_loss; for probes the chosen C). Returns one row
    per (model, method, task) with `<metric>_mean`, `<metric>_std`, `<metric>_seeds` and the choices."""
    rows: dict[tuple[str, str, str], dict] = {}
    for result in results:
        method = result.get("method", "fine-tune")
        row = rows.setdefault(
            (result["model"], method, result["task"]),
            {"model": result["model"], "method": method, "task": result["task"], "pooling": result.get("pooling"),
             "metrics": list(result["validation"]), "runs": []},
        )  # fmt: skip
        row["runs"].append(result)
    for row in rows.values():
        runs = row.pop("runs")
        row["seeds"] = [r["seed"] for r in runs]
        for metric in row["metrics"]:
            values = [r["validation"][metric] for r in runs]
            row[f"{metric}_mean"], row[f"{metric}_std"] = mean_std(values)
            row[f"{metric}_seeds"] = values
        row["seconds"] = round(sum(r["seconds"] for r in runs), 1)
        if row["method"] == "fine-tune":
            row["learning_rate"] = runs[0]["learning_rate"]
            row["rate_grid"] = runs[0].get("rate_grid", {f"{runs[0]['learning_rate']:g}": None})
            row["best_steps"] = [r["best_step"] for r in runs]
            row["still_improving"] = any(r.get("still_improving") for r in runs)
            losses = [r["train_loss"] for r in runs if r.get("train_loss")]
            row["train_loss"] = [statistics.fmean(x[i] for x in losses) for i in (0, 1)] if losses else None
        else:
            row["probe_C"] = [r["probe_C"] for r in runs]
    return list(rows.values())


def choice_cell(row: dict) -> str:
    if row["method"] == "fine-tune":
        note = f" ({STILL_IMPROVING})" if row["still_improving"] else ""
        return f"lr {row['learning_rate']:g}, steps {row['best_steps']}{note}"
    return "C " + ", ".join(f"{c:g}" for c in sorted(set(row["probe_C"])))


def format_markdown(rows: list[dict], baselines: dict, title: str) -> str:
    """`baselines`: task → `task_baselines(...)` (majority metrics and the TF-IDF fit)."""
    lines = [title, ""]
    for task in dict.fromkeys([*(row["task"] for row in rows), *baselines]):
        task_rows = [row for row in rows if row["task"] == task]
        base = baselines.get(task)
        metrics = task_rows[0]["metrics"] if task_rows else list(base["majority"])
        lines += [
            f"Task `{task}` (validation split, evaluated once per run; every choice made on the dev split):",
            "",
            "| model | method | pooling / features | "
            + " | ".join(f"{m} (mean ± std)" for m in metrics)
            + f" | {metrics[0]} per seed | chosen on dev | train loss (first → last tenth) | time (s) |",
            "|---|---|---|" + "---|" * (len(metrics) + 4),
        ]
        for row in task_rows:
            cells = [f"{row[f'{m}_mean']:.4f} ± {row[f'{m}_std']:.4f}" for m in metrics]
            seeds = ", ".join(f"{v:.4f}" for v in row[f"{metrics[0]}_seeds"])
            loss = f"{row['train_loss'][0]:.3f} → {row['train_loss'][1]:.3f}" if row.get("train_loss") else ""
            lines.append(f"| {row['model']} | {row['method']} | {row['pooling']} | " + " | ".join(cells)
                         + f" | {seeds} | {choice_cell(row)} | {loss} | {row['seconds']} |")  # fmt: skip
        if base is not None:
            tfidf = base["tfidf"]
            lines.append(f"| {tfidf['name']} | baseline | bag of n-grams | "
                         + " | ".join(f"{tfidf['validation'][m]:.4f}" for m in metrics)
                         + f" | | {tfidf['parameter']} {tfidf['chosen']:g} | | |")  # fmt: skip
            lines.append("| majority class / mean | baseline | | "
                         + " | ".join(f"{base['majority'][m]:.4f}" for m in metrics) + " | | | | |")  # fmt: skip
        lines.append("")
        graded = [row for row in task_rows if row["method"] == "fine-tune"]
        if graded:
            rates = list(dict.fromkeys(r for row in graded for r in row["rate_grid"]))
            lines += [
                f"Learning rate grid (dev {metrics[0]} of the first seed; the best rate, in bold, is used for every seed):",
                "",
                "| model | " + " | ".join(f"lr {r}" for r in rates) + " |",
                "|---|" + "---|" * len(rates),
            ]
            for row in graded:
                chosen = f"{row['learning_rate']:g}"
                cells = []
                for rate in rates:
                    value = row["rate_grid"].get(rate)
                    text = "" if value is None else f"{value:.4f}"
                    cells.append(f"**{text}**" if rate == chosen and text else text)
                lines.append(f"| {row['model']} | " + " | ".join(cells) + " |")
            lines.append("")
            improving = [row["model"] for row in graded if row["still_improving"]]
            if improving:
                lines += [f"{STILL_IMPROVING}: {', '.join(improving)} (the chosen step was the last one evaluated)", ""]
    return "\n".join(lines)


def plot(rows: list[dict], baselines: dict, path: Path) -> None:
    """Bars of the main metric per task: one per (model, method) with its std as error bar, then the baselines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys([*(row["task"] for row in rows), *baselines]))
    fig, axes = plt.subplots(1, len(tasks), figsize=(max(6, 0.9 * (len(rows) + 2)) * len(tasks) / max(1, len(tasks)) + 2, 4.8),
                             squeeze=False)  # fmt: skip
    for ax, task in zip(axes[0], tasks, strict=True):
        task_rows = [row for row in rows if row["task"] == task]
        main = task_rows[0]["metrics"][0] if task_rows else next(iter(baselines[task]["majority"]))
        labels = [f"{row['model']}\n{row['method']}" for row in task_rows]
        means = [row[f"{main}_mean"] for row in task_rows]
        stds = [row[f"{main}_std"] for row in task_rows]
        colors = ["tab:blue" if row["method"] == "fine-tune" else "tab:green" for row in task_rows]
        if task in baselines:
            labels += ["TF-IDF\n+ linear", "majority"]
            means += [baselines[task]["tfidf"]["validation"][main], baselines[task]["majority"][main]]
            stds += [0.0, 0.0]
            colors += ["tab:gray", "lightgray"]
        ax.bar(range(len(means)), means, yerr=stds, capsize=4, color=colors)
        ax.set_xticks(range(len(means)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{task}: validation {main}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("mean ± std over seeds (blue: fine-tuned, green: probe)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: list[dict], baselines: dict, out_dir: Path, stamp: str, title: str) -> dict[str, Path]:
    """`finetune_<stamp>.{md,json,png}` under `out_dir`; returns their paths. `baselines`: task → its baselines."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = report_rows(results)
    paths = {ext: out_dir / f"finetune_{stamp}.{ext}" for ext in ("md", "json", "png")}
    paths["md"].write_text(format_markdown(rows, baselines, title) + "\n")
    paths["json"].write_text(
        json.dumps({"title": title, "rows": rows, "baselines": baselines, "runs": results}, indent=2, default=str)
    )
    plot(rows, baselines, paths["png"])
    return paths
