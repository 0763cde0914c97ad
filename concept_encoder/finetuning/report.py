"""The fine-tuning report: one row per (model, method, task), metrics as mean ± std over seeds with each
seed's value and how every choice was made on dev (learning rate and step, or the probe's C), beside the
task's baselines (majority class / mean, TF-IDF + linear); markdown, JSON and a grouped bar chart."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from ..common import json_io
from ..common.differences import differences
from ..common.faults import DiskFullError, written_whole
from ..common.report_files import check_report_dir, claim_report_stem

STILL_IMPROVING = "still improving: train longer"


def grid_edge(row: dict) -> str | None:
    """`lowest` or `highest` when the rate chosen on dev is an end of a grid of two or more tried rates and beat
    its neighbour outright (the best rate may lie beyond the grid: extend `--learning_rates` that way), else None.
    A tie with the neighbour says the optimum is flat there, not beyond the grid."""
    grid = sorted((float(rate), score) for rate, score in row.get("rate_grid", {}).items() if score is not None)
    if len(grid) < 2 or row.get("learning_rate") is None:
        return None
    rates = [rate for rate, _ in grid]
    index = min(range(len(rates)), key=lambda i: abs(rates[i] - row["learning_rate"]))
    if index not in (0, len(rates) - 1) or grid[index][1] == grid[1 if index == 0 else -2][1]:
        return None
    return "lowest" if index == 0 else "highest"


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
        row["seconds"] = round(sum(r["seconds"] for r in runs), 1)  # the seeds' runs at the chosen rate
        if "rate_grid_seconds" in runs[0]:  # and the grid's other rates (first seed): what choosing the rate cost
            row["grid_seconds"] = round(sum(runs[0]["rate_grid_seconds"].values()), 1)
        if all("validation_by_position" in r for r in runs):  # the needle task: accuracy by where the needle was
            buckets = runs[0]["validation_by_position"]
            row["accuracy_by_position"] = {
                name: statistics.fmean(r["validation_by_position"][name]["accuracy"] for r in runs) for name in buckets
            }
        if all("validation_last_step" in r for r in runs):  # --report_last_step: where each run ended
            for metric in row["metrics"]:
                row[f"last_step_{metric}_mean"], row[f"last_step_{metric}_std"] = mean_std(
                    [r["validation_last_step"][metric] for r in runs]
                )
        if runs and all("validation_by" in r for r in runs):  # e.g. ListOps: accuracy by tree depth and length
            row["accuracy_by"] = {
                name: {group: statistics.fmean(r["validation_by"][name][group]["accuracy"] for r in runs
                                               if group in r["validation_by"][name]) for group in groups}
                for name, groups in runs[0]["validation_by"].items()
            }  # fmt: skip
        if row["method"] == "fine-tune":
            row["parameters"] = runs[0].get("parameters")
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
            edges = [f"{row['model']} ({edge}, {row['learning_rate']:g})" for row in graded if (edge := grid_edge(row))]
            if edges:
                lines += [f"Chosen at the grid's end, the best rate may lie beyond it (extend --learning_rates): "
                          f"{', '.join(edges)}", ""]  # fmt: skip
            improving = [row["model"] for row in graded if row["still_improving"]]
            if improving:
                lines += [f"{STILL_IMPROVING}: {', '.join(improving)} (the chosen step was the last one evaluated)", ""]
    return "\n".join(lines)


def plot(rows: list[dict], baselines: dict, path: Path) -> None:
    """Horizontal bars of the main metric per task, one per (model, method) with its std as error bar and its
    value written at the end, then the baselines; TF-IDF's score is also a dashed line across the panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys([*(row["task"] for row in rows), *baselines]))
    colors = {"fine-tune": "tab:blue", "probe": "tab:green", "baseline": "tab:gray"}
    height = 0.45 * (max(sum(row["task"] == t for row in rows) for t in tasks) + 2) + 1.2
    fig, axes = plt.subplots(1, len(tasks), figsize=(7.5 * len(tasks), height), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        task_rows = [row for row in rows if row["task"] == task]
        main = task_rows[0]["metrics"][0] if task_rows else next(iter(baselines[task]["majority"]))
        bars = [(f"{row['model']} ({row['method']})", row[f"{main}_mean"], row[f"{main}_std"],
                 colors["fine-tune" if row["method"] == "fine-tune" else "probe"]) for row in task_rows]  # fmt: skip
        if task in baselines:
            bars += [("TF-IDF + linear", baselines[task]["tfidf"]["validation"][main], 0.0, colors["baseline"]),
                     ("majority class / mean", baselines[task]["majority"][main], 0.0, "lightgray")]  # fmt: skip
            ax.axvline(baselines[task]["tfidf"]["validation"][main], color="tab:gray", linestyle="--", linewidth=1)
        labels, means, stds, shades = zip(*bars, strict=True)
        positions = range(len(bars))[::-1]  # the first row on top
        ax.barh(list(positions), means, xerr=stds, capsize=3, color=shades)
        for y, mean, std in zip(positions, means, stds, strict=True):
            ax.text(mean + std, y, f"  {mean:.3f}", va="center", fontsize=8)
        ax.set_yticks(list(positions), labels, fontsize=8)
        ax.set_xlabel(f"validation {main}: mean ± std over seeds")
        ax.set_title(f"{task} (blue: fine-tuned, green: linear probe, grey: baselines)", fontsize=9)
        ax.set_xlim(0, max(means) * 1.15 or 1)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(
    results: list[dict], baselines: dict, out_dir: Path, title: str, prefix: str = "finetune"
) -> dict[str, Path]:
    """`<prefix>_<time>[_NN].{md,json,png}` under `out_dir` (names no other invocation holds); returns their
    paths. `baselines`: task → its baselines. A failure while writing (a full disk) removes all three, so no empty
    or half report is left: a full disk is one line (`DiskFullError`), and the runs it reports are kept."""
    rows = report_rows(results)
    stem = claim_report_stem(out_dir, prefix)
    paths = {ext: Path(f"{stem}.{ext}") for ext in ("md", "json", "png")}
    with written_whole(list(paths.values()), f"the report {stem.name}.*",
                       "free space, then run again (finished runs are reused with --resume_from_checkpoint auto)"):  # fmt: skip
        paths["md"].write_text(format_markdown(rows, baselines, title) + "\n")
        paths["json"].write_text(
            json_io.dumps(
                {"title": title, "rows": rows, "baselines": baselines, "runs": results}, indent=2, default=str
            )
        )
        plot(rows, baselines, paths["png"])
    return paths


def merge_reports(paths: list[Path]) -> tuple[list[dict], dict]:
    """The runs and baselines of several `finetune_<time>.json` reports (e.g. one invocation per model, a
    pretrained model and its `--from_scratch` twin), for one table; a task's baselines are the same in each."""
    runs, baselines, digests = [], {}, {}
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
            runs += report["runs"]
            for task, base in report.get("baselines", {}).items():
                digests.setdefault(task, {}).setdefault(base.get("task_sha256"), path)
                baselines[task] = base
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError, TypeError) as error:
            raise ValueError(f"{path}: not a fine-tuning report ({type(error).__name__}: {error})") from error
    for task, seen in digests.items():
        if len({digest for digest in seen if digest is not None}) > 1:
            raise ValueError(
                f"task {task!r} is not one task across these reports (contents {', '.join(map(str, seen))} in "
                f"{', '.join(map(str, seen.values()))}): merge reports of the same task, or rename one task file"
            )
    return distinct_runs(runs), baselines


def distinct_runs(runs: list[dict]) -> list[dict]:
    """Each run once: the same run in two reports (a copied report, or an invocation resumed with `auto` that
    reused a finished seed) is one seed, not two with a spread of zero. A run is its task, model, method, seed,
    rate and run folder; two different results under one such identity are refused (two models of one name)."""
    kept: dict[tuple, dict] = {}
    protocols: dict[tuple, dict] = {}  # (task, model, method) → the settings its seeds share
    for run in runs:
        if "settings" in run:  # fine-tuning runs: seeds of one row must share every setting but the seed
            shared = {
                k: v for k, v in run["settings"].items() if k not in ("seed", "args.seed", "args.run_name", "model")
            }  # model: its path (model_sha256: what it is)
            row = (run.get("task"), run.get("model"), run.get("method"))
            if differs := differences(protocols.setdefault(row, shared), shared, "one report", "another"):
                raise ValueError(
                    f"the runs of {row[1]} ({row[2]}) on {row[0]} were made under other settings ({'; '.join(differs[:4])}): "
                    "they are not seeds of one protocol; merge reports made with the same settings"
                )
        identity = tuple(json.dumps(run.get(key), default=str)
                         for key in ("task", "model", "method", "seed", "learning_rate", "run_dir"))  # fmt: skip
        if identity in kept:
            if without_timing(kept[identity]) != without_timing(run):
                raise ValueError(
                    f"two different results for {run.get('model')} ({run.get('method')}, seed {run.get('seed')}) on "
                    f"{run.get('task')} in these reports: two models share that name; merge reports of one model per "
                    "name"
                )
            continue
        kept[identity] = run
    return list(kept.values())


def without_timing(run: dict) -> dict:
    return {key: value for key, value in run.items() if key not in ("seconds", "rate_grid_seconds")}


def main(argv: list[str] | None = None) -> int:
    """`python -m concept_encoder finetune_report A.json B.json ...`: one report of several."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m concept_encoder finetune_report", description="Merge fine-tuning reports into one md/json/png."
    )
    parser.add_argument("reports", nargs="+", help="finetune_<time>.json files written by loops/finetune.py")
    parser.add_argument("--out_dir", default="Cache/reports")
    parser.add_argument("--title", default="Fine-tuning and probes, merged")
    args = parser.parse_args(argv)
    try:
        check_report_dir(args.out_dir, "--out_dir")
        runs, baselines = merge_reports(args.reports)
        paths = write_report(runs, baselines, Path(args.out_dir), args.title, prefix="finetune_merged")
    except (ValueError, DiskFullError) as error:
        parser.exit(2, f"error: {error}\n")
    print(paths["md"].read_text())
    print("written:", ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    from ..common.entry import run_tool

    sys.exit(run_tool(main, "python -m concept_encoder finetune_report"))
