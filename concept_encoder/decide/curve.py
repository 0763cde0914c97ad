"""Learning curves: downstream score against pretraining tokens, beside the lines pretraining must cross.

    python -m concept_encoder curve --tokens 0.5M,2M,8M --task embedded -- --dataset docstrings --preset small
    make curve TOKENS=0.5M,2M,8M ARGS="--dataset docstrings" FT_ARGS="--seeds 3"

For each architecture (`--architectures concept,bert`: the Concept Encoder and BERT of the same shape,
same data and settings) one pretraining run (`loops/mlm.py`, `<name>-<arch>`) goes to the largest budget
and saves the model at each smaller one (`--snapshot_steps`; the learning-rate schedule is the one of the
whole run, so an early point is a model mid-schedule, as along any single run). At each point the
fine-tuning loop (`loops/finetune.py --probe`) runs the fair protocol on `--task`: learning rate and step
chosen on dev, several seeds, linear probes. Once per architecture its `--from_scratch` twin goes through
the same protocol, and `--reference` (e.g. the positive control, `make reference`) once. The result is
`Cache/curves/<name>/curve.{md,json,png}`: score against tokens per architecture (fine-tuned, probed),
with horizontal lines for the twins, TF-IDF and the reference.

Under `-- --lr_scheduler_type wsd --decay_steps D --warmup_steps W` each budget's model is instead a finished
schedule: one stable run (`<name>-<arch>`, constant rate after the warm-up, a checkpoint kept at every branch
point, `--checkpoint_steps`) goes to the largest budget minus D, and each budget's short decay
(`<name>-<arch>-decay<step>`) resumes from the stable run's checkpoint D steps before it; the branch is exactly
the wsd run planned to that budget from the start (its rates so far are the stable run's). A budget added later
extends the stable run and branches once more. Cost: one run plus D steps a budget.

Resumable: every finished point is a JSON file under `Cache/curves/<name>/points/` and is reused; an
interrupted pretraining run resumes from its newest checkpoint, an interrupted fine-tuning from its own. A budget
added later extends the finished pretraining run where its learning-rate schedule does not depend on its length
(`--lr_scheduler_type constant --warmup_steps N`); under a decaying schedule it is refused (`extension_problem`).
Gates (`--gate` among the pretraining arguments) are honoured: a run a gate stops gets no points beyond
where it stopped, and the table says so. Budgets become optimizer steps of
`per_device_train_batch_size x gradient_accumulation_steps x num_processes x max_seq_length` tokens
(packed blocks are full), rounded to the nearest step.

This module is the driver: its command line, the curve's summary, table and plot. Planning the runs and points,
running and reusing them, and the checks before the first run are the engine the drivers share (`experiments.py`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..checkpoints.model_folder import model_digest, model_folder_problem
from ..common import json_io
from ..common.cli_types import at_least, yes_no
from ..common.paths import cache_path
from ..constants import ARCHITECTURES
from ..data.sources import source_fingerprint
from .experiments import (
    DRIVER_FLAGS,
    PointFolder,
    add_archive_argument,
    check_archive,
    check_finetune_argv,
    check_reuse,
    decayed_model,
    evaluation_at,
    exclusive,
    holding,
    kept_model,
    parse_budgets,
    parse_choices,
    parse_driver_argv,
    plan_architecture,
    pretrain,
    refuse_driver_flags,
    token_label,
    usage_errors,
)


def curve_request(args, loop_argv: list[str], finetune_argv: list[str]) -> dict:
    """Everything that decides a point's result, budgets aside: the task (and a local task file's content
    fingerprint), the fine-tuning and pretraining arguments, the processes, the reference (and its weights'
    digest: the same folder may hold another model by now)."""
    local = Path(args.task).expanduser().exists()
    return {"task": args.task, "task_files": source_fingerprint(args.task) if local else None,
            "finetune_args": finetune_argv, "pretrain_args": loop_argv, "num_processes": args.num_processes,
            "reference": args.reference,
            "reference_sha256": model_digest(args.reference) if args.reference else None}  # fmt: skip


def main_metric(rows: list[dict]) -> str:
    """The metric a point's report rows lead with (the task's main one)."""
    return rows[0]["metrics"][0]


def summarise(points: list[dict], gate_notes: dict[str, str]) -> dict:
    """Points → one record per (architecture or line, method): main metric mean ± std per budget."""
    curves, lines, baselines = {}, {}, {}
    metric = None
    for point in points:
        baselines.update(point["baselines"])
        metric = metric or main_metric(point["rows"])
        for row in point["rows"]:
            entry = {"mean": row[f"{metric}_mean"], "std": row[f"{metric}_std"], "seeds": row[f"{metric}_seeds"],
                     "learning_rate": row.get("learning_rate"), "still_improving": row.get("still_improving")}  # fmt: skip
            if point["kind"] == "snapshot":
                series = curves.setdefault((point["architecture"], row["method"]), [])
                series.append({"tokens": point["tokens"], "step": point["step"], "eval_loss": point.get("eval_loss"),
                               "unigram_ratio": point.get("unigram_ratio"), **entry})  # fmt: skip
            else:
                lines[(point["label"], row["method"])] = entry
    for series in curves.values():
        series.sort(key=lambda e: e["tokens"])
    return {"metric": metric, "curves": curves, "lines": lines, "baselines": baselines, "gate_notes": gate_notes}


def cell(entry: dict | None) -> str:
    """One table cell: mean (± std over several seeds) and the rate chosen on dev; empty when not measured."""
    if entry is None:
        return ""
    spread = f" ± {entry['std']:.3f}" if len(entry["seeds"]) > 1 else ""
    rate = f" (lr {entry['learning_rate']:g}{', still improving' if entry['still_improving'] else ''})" if (
        entry["learning_rate"]) else ""  # fmt: skip
    return f"{entry['mean']:.3f}{spread}{rate}"


def format_markdown(summary: dict, task: str, name: str) -> str:
    """The curve's table (`curve.md`): a row per architecture and budget, then the lines (twins, reference,
    TF-IDF, majority) and the gates' notes."""
    metric, curves, lines = summary["metric"], summary["curves"], summary["lines"]
    methods = sorted({m for _, m in curves} | {m for _, m in lines}, key=lambda m: (m != "fine-tune", m))
    out = [f"# Learning curve `{name}` on `{task}` (validation {metric}, mean ± std over seeds; choices on dev)", "",
           "| model | pretraining tokens | step | MLM eval loss (accuracy / unigram) | " + " | ".join(methods) + " |",
           "|---|---|---|---|" + "---|" * len(methods)]  # fmt: skip
    for architecture in dict.fromkeys(a for a, _ in curves):
        by_tokens: dict[int, dict] = {}
        for (arch, method), series in curves.items():
            for entry in series if arch == architecture else []:
                by_tokens.setdefault(
                    entry["tokens"],
                    {
                        "step": entry["step"],
                        "eval_loss": entry["eval_loss"],
                        "unigram_ratio": entry.get("unigram_ratio"),
                    },
                )[method] = entry
        for tokens, found in sorted(by_tokens.items()):
            loss = f"{found['eval_loss']:.3f}" if found["eval_loss"] is not None else ""
            loss += f" ({found['unigram_ratio']:.2f}x)" if found["unigram_ratio"] is not None else ""
            out.append(f"| {architecture} | {tokens:,} | {found['step']} | {loss} | "
                       + " | ".join(cell(found.get(m)) for m in methods) + " |")  # fmt: skip
    for label in dict.fromkeys(label for label, _ in lines):
        out.append(f"| {label} | | | | " + " | ".join(cell(lines.get((label, m))) for m in methods) + " |")
    for task_name, base in summary["baselines"].items():
        out.append(f"| TF-IDF + linear ({task_name}) | | | | {base['tfidf']['validation'][metric]:.3f} |"
                   + " |" * (len(methods) - 1))  # fmt: skip
        out.append(f"| majority class / mean | | | | {base['majority'][metric]:.3f} |" + " |" * (len(methods) - 1))
    for architecture, note in summary["gate_notes"].items():
        out += ["", f"- {architecture}: {note}"]
    return "\n".join(out) + "\n"


def plot(summary: dict, path: Path, title: str) -> None:
    """Score against tokens (log axis) per architecture: fine-tuned solid with std bars, probes dashed;
    the twins (dotted, the architecture's colour), TF-IDF (grey) and the reference (black) as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = summary["metric"]
    colours = {architecture: f"C{i}" for i, architecture in enumerate(dict.fromkeys(a for a, _ in summary["curves"]))}
    fig, ax = plt.subplots(figsize=(8, 5))
    for (architecture, method), series in summary["curves"].items():
        tokens = [e["tokens"] for e in series]
        ax.errorbar(tokens, [e["mean"] for e in series], yerr=[e["std"] for e in series], marker="o", capsize=3,
                    color=colours[architecture], linestyle="-" if method == "fine-tune" else "--",
                    label=f"{architecture}, {method}")  # fmt: skip
    for (label, method), entry in summary["lines"].items():
        if method != "fine-tune" and label.endswith("twin"):
            continue  # the twins' probes would crowd the plot; the table has them
        architecture = label.split(" ")[0]
        style = {"color": colours.get(architecture, "black"), "linestyle": ":" if label.endswith("twin") else "-."}
        ax.axhline(entry["mean"], linewidth=1.2, label=f"{label}, {method}", **style)
    for base in summary["baselines"].values():
        ax.axhline(base["tfidf"]["validation"][metric], color="tab:gray", linestyle="--", linewidth=1, label="TF-IDF")
    ax.set_xscale("log")
    ax.set_xlabel("pretraining tokens")
    ax.set_ylabel(f"validation {metric}")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """The curve driver's own arguments (the pretraining arguments come after `--`)."""
    parser = argparse.ArgumentParser(
        prog="python -m concept_encoder curve",
        description="Pretrain once per architecture to the largest token budget; at each budget fine-tune and probe "
                    "on --task under the fair protocol; plot score against tokens beside twins, TF-IDF, a reference.",
        epilog="Everything after `--` goes to loops/mlm.py (the driver sets --architecture, --run_name, --max_steps, "
               "--snapshot_steps and --resume_from_checkpoint).",
    )  # fmt: skip
    parser.add_argument("--tokens", required=True, help="pretraining token budgets, e.g. 0.5M,2M,8M")
    parser.add_argument("--task", default="embedded", help="the downstream task (as loops/finetune.py --task)")
    parser.add_argument("--architectures", default="concept,bert", help=f"comma-separated, from {ARCHITECTURES}")
    parser.add_argument("--name", default="curve", help="the curve's folder under --curves_dir and its run prefix")
    parser.add_argument("--curves_dir", default="Cache/curves")
    parser.add_argument(
        "--reference", help="a pretrained model folder drawn as a line (e.g. Cache/models/all-MiniLM-L6-v2)"
    )
    parser.add_argument("--finetune_args", default="", help='arguments for loops/finetune.py, e.g. "--seeds 3"')
    parser.add_argument("--twins", type=yes_no, default=True,
                        help="also the from-scratch twin of each architecture (default true)")  # fmt: skip
    parser.add_argument("--num_processes", type=at_least(1), default=1, help="processes per run (accelerate launch)")
    add_archive_argument(parser, "curve", "docs/measured/curves")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Check everything, pretrain and measure every point (reusing finished ones), then write the curve's table,
    JSON and plot; 0, or 1 when another process measures the curve or a run failed."""
    parser = build_parser()
    args, loop_argv, finetune_argv = parse_driver_argv(parser, argv)
    with usage_errors(parser):  # every check before the first run starts
        budgets = parse_budgets(args.tokens)
        architectures = parse_choices(args.architectures, "--architectures", ARCHITECTURES)
        refuse_driver_flags(loop_argv, DRIVER_FLAGS, "pretraining arguments", "by the curve driver")
        if args.reference and (problem := model_folder_problem(args.reference)):
            raise ValueError(f"--reference: {problem} (make reference fetches the positive control)")
        plans = [plan_architecture(a, budgets, loop_argv, args.name, args.num_processes) for a in architectures]
        check_finetune_argv(finetune_argv, args.task, [plan.loop_args[1].dataset for plan, _ in plans])
        request = curve_request(args, loop_argv, finetune_argv)
        archive = cache_path(args.archive) / args.name if args.archive else None
        if archive:  # its points become this curve's: the same request only
            check_archive(archive, request, noun="archived curve")
        check_reuse(cache_path(args.curves_dir) / args.name, request, plans)
    point_folder = PointFolder(cache_path(args.curves_dir) / args.name, args.task, finetune_argv, args.num_processes,
                               archive=archive)  # fmt: skip
    if restored := point_folder.restore():
        print(f"{', '.join(restored)} restored from {archive}", flush=True)
    total = len(plans) * (len(budgets) + args.twins) + bool(args.reference)
    progress = iter(range(1, total + 1))
    gate_notes = {}

    def announce(key: str, what: str) -> None:
        print(f"[{next(progress)}/{total}] {key}: {what}", flush=True)

    def reused(key: str) -> None:
        announce(key, "finished earlier, reused")
        point_folder.keep(key)  # into --archive, when one is given

    lock = exclusive(point_folder.folder, f"curve {args.name}")  # a second invocation would train the same runs
    if lock is None:
        return 1
    with holding(lock) as outcome:
        for plan, run_dir in plans:
            keys = [f"{plan.architecture}-{token_label(plan.tokens(step))}" for step in plan.steps]
            pending = [k for k in keys if not point_folder.done(k)]
            ended = pretrain(plan, run_dir, args.num_processes) if pending else None
            if ended and ended["stopped_by_gate"]:
                failed = "; ".join(g.get("gate", str(g)) for g in ended["gates"] if g.get("passed") is False)
                gate_notes[plan.architecture] = f"pretraining stopped by a gate at step {ended['steps']} ({failed})"
            for key, step in zip(keys, plan.steps, strict=True):
                snapshot = kept_model(plan, run_dir, step)
                if not point_folder.done(key) and plan.decay_steps and snapshot.is_dir():  # wsd: the budget's own decay
                    print(f"{key}: decay of {plan.decay_steps} steps to step {step} from {snapshot}", flush=True)
                    evaluated_in = run_dir.parent / f"{plan.run_name}-decay{step}"
                    snapshot = decayed_model(plan, run_dir, step, args.num_processes)
                else:
                    evaluated_in = run_dir
                if point_folder.done(key):
                    reused(key)
                elif snapshot is None or not snapshot.is_dir():
                    announce(
                        key, f"no snapshot at step {step}: {gate_notes.get(plan.architecture, 'run ended before it')}"
                    )
                else:
                    announce(key, f"{plan.tokens(step):,} tokens (step {step}): fine-tuning and probes on {args.task}")
                    info = {"kind": "snapshot", "architecture": plan.architecture, "tokens": plan.tokens(step),
                            "step": step, **evaluation_at(evaluated_in, step)}  # fmt: skip
                    point_folder.measure(key, str(snapshot), [], info)
            if args.twins:
                key = f"{plan.architecture}-twin"
                first = next((run_dir / "snapshots" / f"step-{s}" for s in plan.steps
                              if (run_dir / "snapshots" / f"step-{s}").is_dir()), run_dir / "final")  # fmt: skip
                if point_folder.done(key):
                    reused(key)
                else:
                    announce(key, "from-scratch twin (same architecture, random weights)")
                    point_folder.measure(
                        key, str(first), ["--from_scratch"], {"kind": "line", "label": f"{plan.architecture} twin"}
                    )
        if args.reference:
            key = "reference"
            if point_folder.done(key):
                reused(key)
            else:
                announce(key, f"reference encoder {args.reference}")
                point_folder.measure(
                    key, args.reference, [], {"kind": "line", "label": f"reference {Path(args.reference).name}"}
                )
    if outcome.failed:  # a run failed: finished points and runs stay, the same command continues
        return 1
    summary = summarise(point_folder.points(), gate_notes)
    title = f"{args.name}: validation {summary['metric']} on {args.task} against pretraining tokens"
    (point_folder.folder / "curve.md").write_text(format_markdown(summary, args.task, args.name))
    plot(summary, point_folder.folder / "curve.png", title)
    serialisable = {**summary, "curves": {f"{a} / {m}": s for (a, m), s in summary["curves"].items()},
                    "lines": {f"{label} / {m}": e for (label, m), e in summary["lines"].items()}}  # fmt: skip
    (point_folder.folder / "curve.json").write_text(json_io.dumps(serialisable, indent=2))
    print((point_folder.folder / "curve.md").read_text())
    print(f"curve: {point_folder.folder / 'curve.png'}, table: {point_folder.folder / 'curve.md'}")
    return 0


if __name__ == "__main__":
    from ..common.entry import run_tool

    sys.exit(run_tool(main, "python -m concept_encoder curve"))
