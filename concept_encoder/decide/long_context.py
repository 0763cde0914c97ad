"""Long inputs measured as accuracy: does reading the whole document pay, against the ways BERT reads one?

    python -m concept_encoder long_context --lengths 2048 --tokens 2M -- --preset small
    make long-context LENGTHS=2048 TOKENS=2M

For each length L (tokens an example is read at) the task is `needle:<L x --words_per_token>` (an `embedded`
sentence hidden in about L tokens of the `modules` corpus), or a natural task read up to L (`--task
modules_spliced`: one module's documentation or two halves of different modules; `modules_package`: which
package, where a bag of words is at its ceiling). Every model is pretrained on the long corpus (`--dataset modules`, document blocks) for the same `--tokens`,
then fine-tuned and probed under the fair protocol of the drivers' engine (`experiments.py`: learning rate and
step on dev, seeds, TF-IDF beside), each beside its from-scratch twin:

| row | pretrained at | reads an example as |
|---|---|---|
| `concept-L` | L | the whole input (its cost is linear in L) |
| `bert-trunc` | `--window` (512) | its first `--window` tokens |
| `bert-chunks` | `--window` (the same run) | chunks of `--window` tokens, mean-pooled (`--chunk_length`) |
| `bert-full-L` | L | the whole input, full attention: only for L <= `--full_attention_max` (its time grows as L²) |
| `concept-clock-L` | L, for the wall-clock `bert-trunc`'s pretraining took (`--wall_clock`) | the whole input |
| TF-IDF | | the whole text, and its first `--window` tokens |

Reported per row: validation accuracy mean ± std over seeds, accuracy by needle position (eighths of the input),
the best linear probe, fine-tuning seconds per seed, pretraining seconds, tokens per second and peak memory,
encoder FLOPs per example, parameters: `Cache/reports/long-context_<time>.{md,json,png}` (the JSON's `rows` list).
Resumable like the curve: runs and points live under `Cache/long_context/<name>/` and are reused.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..accounting.flops import mlm_forward_flops
from ..common.cli_types import at_least, yes_no
from ..common.metrics_log import read_metrics
from ..common.paths import cache_path
from ..common.report_files import check_report_dir
from ..tasks.arguments import MODULES_PACKAGE, MODULES_SPLICED
from ..tasks.baselines import task_baselines
from ..tasks.loading import TaskData, load_task
from ..training.args import FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS, parse_args
from . import experiments
from .experiments import (
    PointFolder,
    add_report_driver_arguments,
    check_finetune_argv,
    check_reuse,
    exclusive,
    given_flags,
    holding,
    last_snapshot,
    one_budget,
    parse_choices,
    parse_driver_argv,
    plan_architecture,
    pretrain,
    print_report,
    refuse_driver_flags,
    usage_errors,
    write_report_files,
)

ROWS = ("concept", "trunc", "chunks", "full", "clock")  # --rows: which readings to measure (all by default)
WORDS_PER_TOKEN = 0.5  # the modules corpus reads ~1.9 wordpiece tokens per word: N/2 words fill about N tokens
DRIVER_FLAGS = (*experiments.DRIVER_FLAGS, "--max_seq_length", "--document_blocks")
FINETUNE_DRIVER_FLAGS = (*experiments.FINETUNE_DRIVER_FLAGS, "--max_seq_length", "--chunk_length", "--extend_positions")


@dataclass
class Row:
    """One fine-tuned row: its point key, label, task, the pretraining it reads, how it reads an example."""

    key: str
    label: str
    task: str
    input_length: int  # the length L the task's inputs are made for
    length: int  # tokens of an example the model reads (in chunks: all of them, a window at a time)
    run: tuple  # (plan, run_dir) of its pretraining
    chunk: int | None = None
    twin: bool = True  # also its from-scratch twin (the equal-wall-clock row shares the whole-input row's twin)

    def finetune_extra(self) -> list[str]:
        return ["--max_seq_length", str(self.length), *(["--chunk_length", str(self.chunk)] if self.chunk else [])]


def parse_lengths(text: str, window: int) -> list[int]:
    """`"2048,4096"` → [2048, 4096]; each above `window` (a shorter input needs no long reading)."""
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"--lengths {text!r}: give whole numbers of tokens, e.g. 2048,4096") from None
    if not lengths or lengths[0] <= window:
        raise ValueError(f"--lengths {text!r}: every length must be above --window {window} (what truncation reads)")
    return lengths


def task_for(task: str, length: int, words_per_token: float) -> str:
    return f"needle:{max(16, round(length * words_per_token))}" if task == "needle" else task


def pretraining_cost(run_dir: Path) -> dict:
    """Training seconds (logged step times, evaluations excluded), tokens, tokens per second and peak memory (GB:
    the GPU's peak allocation where there is one, else the process RSS) of a finished pretraining run."""
    records = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"}
    seconds, previous = 0.0, 0
    for step in sorted(records):
        seconds += (step - previous) * records[step]["step_time_s"]
        previous = step
    tokens = json.loads((run_dir / "summary.json").read_text())["tokens_seen"]
    peaks = [r.get("cuda_peak_allocated_gb", r.get("rss_gb", 0.0)) for r in records.values()]
    return {"pretrain_seconds": round(seconds, 1), "pretrain_tokens": tokens,
            "tokens_per_second": round(tokens / seconds, 1) if seconds else None,
            "peak_memory_gb": max(peaks, default=None)}  # fmt: skip


def forward_flops(config_path: Path, length: int, chunk: int | None) -> float:
    """Matmul FLOPs of the encoder reading one example of `length` tokens (in chunks of `chunk`)."""
    config = json.loads(config_path.read_text())
    if chunk:
        return -(-length // chunk) * mlm_forward_flops(config, chunk, mlm_probability=0.0)
    return mlm_forward_flops(config, length, mlm_probability=0.0)


def wall_clock_plan(args, base: list[str], length: int, concept_run: tuple, window_run: tuple) -> tuple | None:
    """The Concept Encoder's pretraining at `length` for as long as BERT's at the window took (seconds from their
    finished runs' logged step times), with the whole-input run's batch; None when that is the whole-input run's
    own number of steps (which then is the equal-wall-clock row too)."""
    plan, run_dir = concept_run
    per_step = pretraining_cost(run_dir)["pretrain_seconds"] / plan.steps[-1]
    steps = max(1, round(pretraining_cost(window_run[1])["pretrain_seconds"] / per_step)) if per_step else 0
    if steps in (0, plan.steps[-1]):
        return None
    return plan_architecture("concept", [steps * plan.tokens_per_step], [*base, "--max_seq_length", str(length)],
                             f"{args.name}-L{length}-clock", args.num_processes)  # fmt: skip


def measure_row(folder: Path, row: Row, finetune_argv: list[str], processes: int) -> dict:
    """The row's points (pretrained, and its twin): fine-tuning and probes under the fair protocol, reused when
    measured before. `{"row", "pretrained", "twin"}`."""
    points = PointFolder(folder, row.task, finetune_argv, processes)
    model = str(last_snapshot(*row.run))
    result = {"row": row}
    for kind in ("pretrained", "twin") if row.twin else ("pretrained",):
        key = row.key if kind == "pretrained" else f"{row.key}-twin"
        extra = [*row.finetune_extra(), *(["--from_scratch"] if kind == "twin" else [])]
        what = f"{row.label}{', from scratch' if kind == 'twin' else ''}, fine-tuning and probes on {row.task}"
        result[kind] = points.reused_or_measured(key, model, extra, {"kind": "line", "label": row.label,
                                                                     "variant": kind}, what)  # fmt: skip
    return result


def first_tokens(task, tokenizer, window: int):
    """`task` with every text cut after its first `window` tokens (special tokens included), as truncated BERT reads it."""

    def cut(split):
        texts = list(split["text_a"])
        encoded = tokenizer(texts, truncation=True, max_length=window, return_offsets_mapping=True)
        ends = [max((end for _, end in offsets), default=0) for offsets in encoded["offset_mapping"]]
        return split.remove_columns("text_a").add_column("text_a", [t[:e] for t, e in zip(texts, ends, strict=True)])

    return TaskData(f"{task.name}-first{window}", task.task_type, task.num_labels, task.label_names,
                    task.metric_names, cut(task.train), cut(task.dev), cut(task.validation))  # fmt: skip


def named_task(task_name: str, finetune_argv: list[str]) -> TaskData:
    """The task as fine-tuning loads it under these arguments."""
    _, task_args, _ = parse_args(["--model_name_or_path", ".", "--task", task_name, *finetune_argv],
                                 classes=FINETUNE_ARGUMENT_CLASSES, defaults=FINETUNE_DEFAULTS)  # fmt: skip
    return load_task(task_args)


def validation_tokens(task: TaskData, tokenizer) -> list[int]:
    """Each validation example's tokens, uncut (special tokens included): what a reading of L tokens cuts."""
    return [len(ids) for ids in tokenizer(list(task.validation["text_a"]), truncation=False)["input_ids"]]


def tfidf_rows(
    task_name: str, whole: dict, finetune_argv: list[str], tokenizer_folder: Path, window: int
) -> list[dict]:
    """TF-IDF on the whole text (the points' own baseline) and on the first `window` tokens (fitted here, cached)."""
    from transformers import AutoTokenizer

    task = named_task(task_name, finetune_argv)
    cut = task_baselines(first_tokens(task, AutoTokenizer.from_pretrained(tokenizer_folder), window),
                         cache_dir=cache_path("Cache"))  # fmt: skip
    rows = []
    for label, fit in (("TF-IDF, whole text", whole), (f"TF-IDF, first {window} tokens", cut["tfidf"])):
        rows.append({"model": label, "key": f"tfidf-{'whole' if fit is whole else 'first'}", "task": task_name,
                     "max_seq_length": None, "pretrained": None, "accuracy_mean": fit["validation"]["accuracy"],
                     "accuracy_std": 0.0, "accuracy_by_position": positions_of(fit.get("validation_by_position")),
                     "train_seconds": None, "tokens_per_second": None})  # fmt: skip
    return rows


def positions_of(buckets: dict | None) -> dict | None:
    """`{"0-12%": {"accuracy", "count"}}` → `{"0-12%": accuracy}` (already plain: unchanged)."""
    if buckets is None:
        return None
    return {name: value["accuracy"] if isinstance(value, dict) else value for name, value in buckets.items()}


def assemble(measured: list[dict], tasks: dict, finetune_argv: list[str], args, tokenizer_folder: Path) -> dict:
    """The report: one row per model and reading (pretrained and twin), TF-IDF rows per task, and the goal lines.
    Each model row says the share of validation examples longer than it reads (`validation_cut`): a "whole input"
    row reads the first L tokens of those."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    lengths = {task: validation_tokens(named_task(task, finetune_argv), tokenizer)
               for task in dict.fromkeys(found["row"].task for found in measured)}  # fmt: skip
    rows, by_task = [], {}
    for found in measured:
        row = found["row"]
        cut = sum(n > row.length for n in lengths[row.task]) / max(len(lengths[row.task]), 1)
        cost = pretraining_cost(row.run[1])
        for kind in ("pretrained", "twin"):
            if kind not in found:
                continue
            point = found[kind]
            by_task.setdefault(row.task, point["baselines"][row.task]["tfidf"])
            tuned = next(r for r in point["rows"] if r["method"] == "fine-tune")
            probes = [r for r in point["rows"] if r["method"] != "fine-tune"]
            probe = max(probes, key=lambda r: r["accuracy_mean"]) if probes else None
            config = last_snapshot(*row.run) / "config.json"
            rows.append({
                "model": row.label if kind == "pretrained" else f"{row.label}, from scratch", "key": row.key,
                "task": row.task, "input_length": row.input_length, "max_seq_length": row.length,
                "chunk_length": row.chunk, "pretrained": kind == "pretrained", "validation_cut": cut,
                "accuracy_mean": tuned["accuracy_mean"], "accuracy_std": tuned["accuracy_std"],
                "accuracy_seeds": tuned["accuracy_seeds"], "accuracy_by_position": tuned.get("accuracy_by_position"),
                "probe": probe and {"features": probe["method"], "accuracy_mean": probe["accuracy_mean"],
                                    "accuracy_by_position": probe.get("accuracy_by_position")},
                "train_seconds": round(tuned["seconds"] / len(tuned["seeds"]), 1),
                **(cost if kind == "pretrained" else dict.fromkeys(cost)),
                "flops_per_example": forward_flops(config, row.length, row.chunk),
                "parameters": tuned.get("parameters"),
            })  # fmt: skip
    for task_name, whole in by_task.items():
        rows += tfidf_rows(task_name, whole, finetune_argv, tokenizer_folder, args.window)  # the runs share one
    return {"title": f"Long inputs: {args.task} at {', '.join(str(n) for n in sorted(set(tasks)))} tokens, "
                     f"{args.tokens} pretraining tokens per model", "task": args.task, "window": args.window,
            "tokens": args.tokens, "full_attention_max": args.full_attention_max, "rows": rows,
            "goals": goal_lines(rows, args)}  # fmt: skip


def goal_lines(rows: list[dict], args) -> list[str]:
    """The issue's goals, measured: whole-input Concept Encoder against truncated BERT and TF-IDF, and the
    fine-tuning time of BERT with full attention against the Concept Encoder's."""
    target = 10 if args.task == "needle" else 3
    lines = []
    readings = list(dict.fromkeys((r["task"], r["key"].removeprefix("concept-L")) for r in rows
                                  if r["key"].startswith("concept-L") and r["pretrained"]))  # fmt: skip
    several = len(readings) > len({task for task, _ in readings})  # a task read at several lengths: each named
    for task, length in readings:  # one line per task and length, each against its own readings
        found = {r["key"]: r for r in rows if r["task"] == task and r["pretrained"] is not False}
        concept = found[f"concept-L{length}"]
        trunc, full = found.get(f"bert-trunc-L{length}"), found.get(f"bert-full-L{length}")
        tfidf = found.get("tfidf-whole")
        at = f" at {length} tokens" if several else ""
        line = f"`{task}`{at}: Concept Encoder {concept['accuracy_mean']:.3f} ± {concept['accuracy_std']:.3f}"
        if cut := concept.get("validation_cut"):  # longer than it reads: not the whole input there
            line += f" (reading the first {concept['max_seq_length']} tokens of the {cut:.0%} of examples longer)"
        if trunc:
            gain = 100 * (concept["accuracy_mean"] - trunc["accuracy_mean"])
            line += (f"; BERT on the first {args.window} tokens {trunc['accuracy_mean']:.3f}: {gain:+.1f} points "
                     f"(goal +{target}: {'met' if gain >= target else 'missed'})")  # fmt: skip
        if tfidf:
            beats = concept["accuracy_mean"] > tfidf["accuracy_mean"]
            line += f"; TF-IDF on the whole text {tfidf['accuracy_mean']:.3f} ({'beaten' if beats else 'not beaten'})"
        if full:
            ratio = full["train_seconds"] / concept["train_seconds"] if concept["train_seconds"] else float("nan")
            line += (
                f"; fine-tuning per seed {concept['train_seconds']:.0f} s against BERT with full attention "
                f"{full['train_seconds']:.0f} s: {ratio:.1f}x (goal 3x: {'met' if ratio >= 3 else 'missed'})"
            )
        else:
            why = (
                "left out by --rows"
                if "full" not in args.rows
                else f"above --full_attention_max {args.full_attention_max}"
            )
            line += f"; BERT with full attention not run ({why})"
        lines.append(line)
    return lines


def format_markdown(report: dict) -> str:
    buckets = list(dict.fromkeys(b for r in report["rows"] for b in (r.get("accuracy_by_position") or {})))
    positions = "; by needle position: accuracy of the examples whose needle lies in each eighth of the input" if (
        buckets) else ""  # fmt: skip
    out = [f"# {report['title']}", "", f"Validation accuracy, mean ± std over seeds (rate and step chosen on dev){positions}.", "",
           "| model | task | reads | accuracy | best probe | " + " | ".join(buckets) + (" | " if buckets else "")
           + "fine-tune s/seed | pretrain s | tokens/s | peak GB | GFLOP/example | parameters |",
           "|---|---|---|---|---|" + "---|" * len(buckets) + "---|---|---|---|---|---|"]  # fmt: skip
    for r in report["rows"]:
        reads = "" if r["max_seq_length"] is None else f"{r['max_seq_length']}" + (
            f" in {r['chunk_length']}s" if r.get("chunk_length") else "") + (
            f" ({r['validation_cut']:.0%} cut)" if r.get("validation_cut") else "")  # fmt: skip
        probe = f"{r['probe']['accuracy_mean']:.3f} ({r['probe']['features']})" if r.get("probe") else ""
        position = r.get("accuracy_by_position") or {}
        cells = [f"{position[b]:.2f}" if b in position else "" for b in buckets]

        def number(key, form, r=r):
            return "" if r.get(key) is None else format(r[key], form)

        gflops = "" if r.get("flops_per_example") is None else f"{r['flops_per_example'] / 1e9:.2f}"
        out.append(f"| {r['model']} | {r['task']} | {reads} | {r['accuracy_mean']:.3f} ± {r['accuracy_std']:.3f} | "
                   f"{probe} | " + "".join(f"{c} | " for c in cells) + f"{number('train_seconds', '.0f')} | "
                   f"{number('pretrain_seconds', '.0f')} | {number('tokens_per_second', ',.0f')} | "
                   f"{number('peak_memory_gb', '.2f')} | {gflops} | {number('parameters', ',')} |")  # fmt: skip
    out += ["", "Goals:", *[f"- {line}" for line in report["goals"]]]
    return "\n".join(out) + "\n"


def plot(report: dict, path: Path) -> None:
    """Left: accuracy ± std per row (pretrained dark, from scratch light, TF-IDF grey). Right: accuracy by needle
    position per pretrained row (where the information is lost)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(13, 5))
    colours = ["tab:gray" if r["pretrained"] is None else "C0" if r["pretrained"] else "C9" for r in rows]
    labels = [f"{r['model']} [{r['task']}]" for r in rows]
    bars.barh(range(len(rows)), [r["accuracy_mean"] for r in rows], xerr=[r["accuracy_std"] for r in rows],
              color=colours, capsize=3)  # fmt: skip
    bars.set_yticks(range(len(rows)), labels, fontsize=7)
    bars.invert_yaxis()
    bars.set_xlabel("validation accuracy")
    bars.grid(axis="x", alpha=0.3)
    for r in rows:
        if r.get("accuracy_by_position") and r["pretrained"] is not False:
            names = list(r["accuracy_by_position"])
            lines.plot(range(len(names)), list(r["accuracy_by_position"].values()), marker="o",
                       label=f"{r['model']} [{r['task']}]")  # fmt: skip
            lines.set_xticks(range(len(names)), names, fontsize=7)
    lines.set_xlabel("needle position (share of the input before it)")
    lines.set_ylabel("validation accuracy")
    lines.grid(alpha=0.3)
    if lines.lines:
        lines.legend(fontsize=6)
    fig.suptitle(report["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m concept_encoder long_context",
        description="Pretrain on long documents, fine-tune on a long-document task, and compare the Concept "
                    "Encoder reading the whole input with BERT truncated, BERT over chunks, BERT with full "
                    "attention, TF-IDF and the twins.",
        epilog="Everything after `--` goes to every pretraining run (loops/mlm.py); the driver sets "
               "--max_seq_length, --document_blocks, --architecture, --run_name, --max_steps, --snapshot_steps.",
    )  # fmt: skip
    parser.add_argument("--lengths", default="2048", help="tokens an example is read at, e.g. 2048,4096")
    parser.add_argument("--tokens", default="2M", help="pretraining tokens of every pretrained model (equal)")
    parser.add_argument("--task", default="needle", choices=("needle", MODULES_SPLICED, MODULES_PACKAGE),
                        help="needle:<words> made for each length, or a natural task read up to each length")  # fmt: skip
    parser.add_argument("--window", type=at_least(8), default=512, help="what truncated/chunked BERT reads at once")
    parser.add_argument("--words_per_token", type=float, default=WORDS_PER_TOKEN,
                        help="needle haystack words per token of length (0.5 fills about L tokens)")  # fmt: skip
    parser.add_argument("--full_attention_max", type=at_least(0), default=2048,
                        help="BERT with full attention only at lengths up to this (its cost grows as L²)")  # fmt: skip
    parser.add_argument("--wall_clock", type=yes_no, default=True,
                        help="also the Concept Encoder pretrained for bert-trunc's wall-clock (default true)")  # fmt: skip
    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"the readings to measure, comma-separated from {ROWS} (concept is always measured)")  # fmt: skip
    add_report_driver_arguments(parser, "long-context", "Cache/long_context")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, loop_argv, finetune_argv = parse_driver_argv(parser, argv)
    folder = cache_path(args.runs_dir) / args.name
    with usage_errors(parser):  # every check before the first run starts
        lengths = parse_lengths(args.lengths, args.window)
        budget = one_budget(args.tokens, "every model is pretrained for as many")
        refuse_driver_flags(loop_argv, DRIVER_FLAGS, "pretraining arguments", "by the long-context driver")
        refuse_driver_flags(finetune_argv, FINETUNE_DRIVER_FLAGS, "--finetune_args:", "by the long-context driver")
        chosen = {*parse_choices(args.rows, "--rows", ROWS), "concept"}
        if not 0 < args.words_per_token <= 1:
            raise ValueError(f"--words_per_token {args.words_per_token} must be in (0, 1]")
        tasks = {length: task_for(args.task, length, args.words_per_token) for length in lengths}
        base = [*loop_argv, *([] if given_flags(loop_argv, ("--dataset",)) else ["--dataset", "modules"])]
        base.append("--document_blocks")

        def plan(architecture: str, length: int, tag: str) -> tuple:
            argv = [*base, "--max_seq_length", str(length)]
            return plan_architecture(architecture, [budget], argv, f"{args.name}-{tag}", args.num_processes)

        window_bert = plan("bert", args.window, f"W{args.window}") if chosen & {"trunc", "chunks", "clock"} else None
        concept = {length: plan("concept", length, f"L{length}") for length in lengths}
        full = {length: plan("bert", length, f"L{length}") for length in lengths
                if "full" in chosen and length <= args.full_attention_max}  # fmt: skip
        runs = [*([window_bert] if window_bert else []), *concept.values(), *full.values()]
        for task in dict.fromkeys(tasks.values()):  # loads it (hours of pretraining need a task that loads), and
            check_finetune_argv(
                finetune_argv, task, [p.loop_args[1].dataset for p, _ in runs], "long-context"
            )  # no held-out text read
        request = {"lengths": lengths, "tokens": budget, "task": args.task, "window": args.window,
                   "words_per_token": args.words_per_token, "finetune_args": finetune_argv, "pretrain_args": base,
                   "num_processes": args.num_processes, "rows": sorted(chosen)}  # fmt: skip
        check_report_dir(args.report_dir)  # before the request is recorded: a refusal leaves nothing behind
        check_reuse(folder, request, runs, noun="point folder", folder_flag="--runs_dir")
    lock = exclusive(folder, f"long-context {args.name}")
    if lock is None:
        return 1
    with holding(lock) as outcome:
        for pretraining, run_dir in runs:
            print(f"pretraining {pretraining.run_name}: {pretraining.tokens(pretraining.steps[-1]):,} tokens",
                  flush=True)  # fmt: skip
            pretrain(pretraining, run_dir, args.num_processes)
        rows = []
        for length in lengths:
            task = tasks[length]
            rows.append(
                Row(f"concept-L{length}", "Concept Encoder, whole input", task, length, length, concept[length])
            )
            if "trunc" in chosen:
                rows.append(Row(f"bert-trunc-L{length}", f"BERT, first {args.window} tokens", task, length, args.window,
                                window_bert))  # fmt: skip
            if "chunks" in chosen:
                rows.append(Row(f"bert-chunks-L{length}", f"BERT, {args.window}-token chunks mean-pooled", task,
                                length, length, window_bert, chunk=args.window))  # fmt: skip
            if length in full:
                rows.append(Row(f"bert-full-L{length}", "BERT, full attention", task, length, length, full[length]))
            clock = "clock" in chosen and args.wall_clock and wall_clock_plan(args, base, length, concept[length],
                                                                              window_bert)  # fmt: skip
            if clock:
                print(f"pretraining {clock[0].run_name}: the wall-clock of {window_bert[0].run_name}", flush=True)
                pretrain(*clock, args.num_processes)
                rows.append(Row(f"concept-clock-L{length}", "Concept Encoder, bert-trunc's pretraining wall-clock",
                                task, length, length, clock, twin=False))  # fmt: skip
        # the fine-tuning runs live in this driver's folder (unless --output_dir says otherwise): their names come
        # from --name, so two drivers of one name under other --runs_dir would otherwise meet in Cache/finetune
        own = (
            [] if given_flags(finetune_argv, ("--output_dir",)) else ["--output_dir", str(folder / "finetune" / "runs")]
        )
        measured = [measure_row(folder, row, [*finetune_argv, *own], args.num_processes) for row in rows]
    if outcome.failed:  # a run failed: finished runs and points stay, the same command continues
        return 1
    report = assemble(measured, tasks, finetune_argv, args, last_snapshot(*concept[lengths[0]]))
    print_report(write_report_files(report, args.report_dir, "long-context", format_markdown, plot))
    return 0


if __name__ == "__main__":
    from ..common.entry import run_tool

    sys.exit(run_tool(main, "python -m concept_encoder long_context"))
