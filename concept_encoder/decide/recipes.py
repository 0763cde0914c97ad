"""Which pretraining pays at a small budget: recipe arms against their from-scratch twins, under the fair protocol.

    python -m concept_encoder recipes --tokens 2M --tasks embedded,embedded_pairs -- --preset small
    make recipes TOKENS=2M SEEDS=3

Each arm changes how the model is pretrained on `--corpus` (the docstring corpus by default), nothing else:

| arm | pretraining arguments |
|---|---|
| `default` | the loop's defaults |
| `tapt` | `--dataset <corpus>,task:<task>*<--task_weight>`: the task's own training texts beside the corpus (task-adaptive pretraining; one run per task) |
| `budget` | `--recipe budget` (rate 1e-3 decayed to zero at the run's end, masking 0.25, no dropout) |
| `distill` | `--objective distill --teacher <--teacher> --packing false`: the teacher's sentence embeddings beside MLM |
| `distill-init` | `distill` with `--teacher_embedding_init --tokenizer <--teacher>`: word embeddings from the teacher's |

For each architecture (`--architectures concept,bert`) and arm, one pretraining run of `--tokens` (the engine's
`plan_architecture`: one budget, so a decaying schedule ends where the run ends), then per task one point under
the curve's protocol (`experiments.PointFolder.measure`: rate and step on dev, seeds, linear probes, TF-IDF).
Every model stands beside its from-scratch twin: same architecture and tokenizer, random weights; arms whose
tokenizers are equal share one twin (their twin is the same model). Budgets are optimizer steps of full blocks:
the distillation arms read one document per example (shorter than a block), so at equal steps they see fewer
tokens; the report gives the tokens each run saw.

The report, `Cache/reports/recipes_<time>.{md,json,png}`: per task, architecture and arm the accuracy ± std over
seeds, the twin's, the gain and the gain in standard errors (`gain / sqrt(s1²/n1 + s2²/n2)`), the probes of the
concepts' mean and of the input embeddings' mean (what MLM leaves in the bottleneck), TF-IDF; the goal lines. The
JSON holds a `rows` list. Resumable like the curve: runs and points under `Cache/recipes/<name>/` are reused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

from ..checkpoints.model_folder import model_folder_problem
from ..common.paths import cache_path
from ..common.report_files import check_report_dir
from ..constants import ARCHITECTURES
from . import experiments
from .ablate import safe_name
from .experiments import (
    PointFolder,
    add_report_driver_arguments,
    check_finetune_argv,
    check_reuse,
    exclusive,
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

ARMS = ("default", "tapt", "budget", "distill", "distill-init")
DISTILL_ARMS = ("distill", "distill-init")
DEFAULT_TEACHER = "Cache/models/all-MiniLM-L6-v2"  # `make reference`
# set per arm by the driver: given after `--` they would make every arm the same run
DRIVER_FLAGS = (*experiments.DRIVER_FLAGS, "--dataset", "--recipe", "--objective", "--teacher", "--packing",
                "--teacher_embedding_init")  # fmt: skip
GOAL_GAIN, GOAL_SE, GOAL_DISTILLED = 0.02, 2.0, 0.828  # +2 points beyond 2 standard errors; 97% of MiniLM's 0.854


def arm_arguments(arm: str, corpus: str, task: str, task_weight: float, teacher: str) -> list[str]:
    """The pretraining arguments `arm` adds to the common ones."""
    distill = ["--objective", "distill", "--teacher", teacher, "--packing", "false"]
    return {
        "default": ["--dataset", corpus],
        "tapt": ["--dataset", f"{corpus},task:{task}*{task_weight:g}"],
        "budget": ["--dataset", corpus, "--recipe", "budget"],
        "distill": ["--dataset", corpus, *distill],
        "distill-init": ["--dataset", corpus, *distill, "--teacher_embedding_init", "--tokenizer", teacher],
    }[arm]


def tokenizer_digest(model: Path) -> str:
    """What makes two models' tokenizers one (the twin of either is the same model): their saved tokenizer files,
    without the truncation and padding a tokenizer saved after use remembers (how it was last called)."""
    digest = hashlib.sha1()
    if (model / "tokenizer.json").is_file():
        saved = json.loads((model / "tokenizer.json").read_text())
        kept = {k: v for k, v in saved.items() if k not in ("truncation", "padding")}
        digest.update(json.dumps(kept, sort_keys=True).encode())
    if (model / "vocab.txt").is_file():
        digest.update((model / "vocab.txt").read_bytes())
    return digest.hexdigest()[:10]


def standard_error(row: dict) -> float:
    """The standard error of a fine-tuned row's mean over its seeds (its std over sqrt(n))."""
    return row["accuracy_std"] / math.sqrt(len(row["accuracy_seeds"])) if row["accuracy_seeds"] else 0.0


def summary_row(point: dict, task: str) -> dict:
    """A point's fine-tuned accuracy (mean, std, seeds) and its probes by features."""
    tuned = next(r for r in point["rows"] if r["method"] == "fine-tune")
    probes = {
        r["method"].removeprefix("probe: "): r["accuracy_mean"] for r in point["rows"] if r["method"] != "fine-tune"
    }
    return {"accuracy_mean": tuned["accuracy_mean"], "accuracy_std": tuned["accuracy_std"],
            "accuracy_seeds": tuned["accuracy_seeds"], "learning_rate": tuned.get("learning_rate"), "probes": probes,
            "tfidf": point["baselines"][task]["tfidf"]["validation"]["accuracy"],
            "majority": point["baselines"][task]["majority"]["accuracy"]}  # fmt: skip


def compare(pretrained: dict, twin: dict) -> dict:
    """Gain of the pretrained model over its twin, in accuracy and in standard errors of the difference (None
    without a spread to measure it by: one seed each, or seeds that agree exactly)."""
    gain = pretrained["accuracy_mean"] - twin["accuracy_mean"]
    error = math.sqrt(standard_error(pretrained) ** 2 + standard_error(twin) ** 2)
    return {"gain": gain, "gain_se": gain / error if error else None}


def se_text(value: float | None) -> str:
    return "no spread over seeds" if value is None else f"{value:+.1f} SE"


def goal_lines(rows: list[dict], planned: list[str] | None = None, default_teacher: bool = True) -> list[str]:
    """The issue's goals, measured: an arm whose Concept Encoder beats its twin by 2 points beyond 2 standard
    errors on every task of `planned` (default: those measured); a distilled Concept Encoder at 0.828 on `embedded`
    (the default teacher's goal); concepts probing at least as well as the mean of the input embeddings. A goal
    held on the tasks measured so far, with planned ones missing, is "not yet decided"."""
    concept = [r for r in rows if r["architecture"] == "concept"]
    tasks = planned or sorted({r["task"] for r in rows})
    lines = []
    for arm in dict.fromkeys(r["arm"] for r in concept):
        found = {r["task"]: r for r in concept if r["arm"] == arm}
        held = [t for t in found if found[t]["gain"] >= GOAL_GAIN and (found[t]["gain_se"] or 0) > GOAL_SE]
        missing = [t for t in tasks if t not in found]
        verdict = ("missed" if len(held) < len(found)
                   else f"not yet decided ({', '.join(missing)} not measured yet)" if missing else "met")  # fmt: skip
        gains = "; ".join(f"{t} {100 * r['gain']:+.1f} points ({se_text(r['gain_se'])})" for t, r in found.items())
        lines.append(f"`{arm}`, Concept Encoder against its twin: {gains}: goal (+2 points, > 2 SE on every task) "
                     f"{verdict}")  # fmt: skip
        probes = [r for r in found.values() if {"concepts mean", "embeddings mean"} <= set(r["probes"])]
        for r in probes:
            concepts, embeddings = r["probes"]["concepts mean"], r["probes"]["embeddings mean"]
            lines.append(f"`{arm}` on {r['task']}: concepts probe {concepts:.3f}, input embeddings' mean "
                         f"{embeddings:.3f} ({'at least as well' if concepts >= embeddings else 'below'})")  # fmt: skip
        if arm in DISTILL_ARMS and "embedded" in found and default_teacher:  # the goal is the default teacher's
            score = found["embedded"]["accuracy_mean"]
            lines.append(f"`{arm}` on embedded: {score:.3f} against the goal {GOAL_DISTILLED} (97% of the teacher's "
                         f"0.854): {'met' if score >= GOAL_DISTILLED else 'missed'}; TF-IDF "
                         f"{found['embedded']['tfidf']:.3f} ({'beaten' if score > found['embedded']['tfidf'] else 'not beaten'})")  # fmt: skip
    return lines


def format_markdown(report: dict) -> str:
    out = [f"# {report['title']}", "", "Validation accuracy, mean ± std over seeds (rate and step chosen on dev); "
           "gain: pretrained minus its from-scratch twin, in points and in standard errors of the difference.", "",
           "| task | architecture | arm | pretrained | twin | gain | gain / SE | probe: concepts mean | "
           "probe: embeddings mean | pretraining tokens seen | eval loss (x unigram) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in report["rows"]:
        probes = r["probes"]
        concept_probe = probes.get("concepts mean", probes.get("hidden mean"))
        embeddings = probes.get("embeddings mean")
        loss = "" if r.get("eval_loss") is None else f"{r['eval_loss']:.3f}" + (
            f" ({r['unigram_ratio']:.2f}x)" if r.get("unigram_ratio") else "")  # fmt: skip
        out.append(
            f"| {r['task']} | {r['architecture']} | {r['arm']} | {r['accuracy_mean']:.3f} ± {r['accuracy_std']:.3f} | "
            f"{r['twin']['accuracy_mean']:.3f} ± {r['twin']['accuracy_std']:.3f} | {100 * r['gain']:+.1f} | "
            f"{'' if r['gain_se'] is None else format(r['gain_se'], '+.1f')} | {'' if concept_probe is None else f'{concept_probe:.3f}'} | "
            f"{'' if embeddings is None else f'{embeddings:.3f}'} | {r['tokens_seen']:,} | {loss} |"
        )
    for task, base in report["baselines"].items():
        out.append(f"| {task} | TF-IDF + linear | | {base['tfidf']:.3f} | | | | | | | |")
        out.append(f"| {task} | majority class | | {base['majority']:.3f} | | | | | | | |")
    out += ["", "Goals:", *[f"- {line}" for line in report["goals"]]]
    return "\n".join(out) + "\n"


def plot(report: dict, path: Path) -> None:
    """One panel per task: per architecture and arm, the pretrained model's accuracy (bar, ± std) beside its twin's
    (hatched), TF-IDF as a grey line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in report["rows"]))
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        rows = [r for r in report["rows"] if r["task"] == task]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["accuracy_mean"] for r in rows], 0.4, yerr=[r["accuracy_std"] for r in rows],
               capsize=3, color=["C0" if r["architecture"] == "concept" else "C1" for r in rows], label="pretrained")  # fmt: skip
        ax.bar([i + 0.2 for i in x], [r["twin"]["accuracy_mean"] for r in rows], 0.4,
               yerr=[r["twin"]["accuracy_std"] for r in rows], capsize=3, color="white", edgecolor="grey",
               hatch="//", label="from-scratch twin")  # fmt: skip
        ax.axhline(report["baselines"][task]["tfidf"], color="grey", linestyle="--", label="TF-IDF")
        ax.set_xticks(list(x), [f"{r['architecture']}\n{r['arm']}" for r in rows], fontsize=7)
        low = min(min(r["accuracy_mean"], r["twin"]["accuracy_mean"]) for r in rows)
        ax.set_ylim(max(0.0, low - 0.1), 1.0)
        ax.set_title(task, fontsize=9)
        ax.set_ylabel("validation accuracy")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(report["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m concept_encoder recipes",
        description="Pretrain one model per recipe arm and architecture, fine-tune and probe each beside its "
        "from-scratch twin on each task, report the gains in standard errors.",
        epilog="Arguments after `--` go to every pretraining run (loops/mlm.py) except those the driver sets: "
        f"{', '.join(DRIVER_FLAGS)}.",
    )
    parser.add_argument("--tokens", default="2M", help="pretraining tokens of every run (one budget)")
    parser.add_argument("--tasks", default="embedded,embedded_pairs", help="fine-tuning tasks, comma-separated")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"which arms, from {ARMS}")
    parser.add_argument("--architectures", default=",".join(ARCHITECTURES), help=f"from {ARCHITECTURES}")
    parser.add_argument("--corpus", default="docstrings", help="what every arm pretrains on (--dataset)")
    parser.add_argument("--task_weight", type=float, default=8.0,
                        help="tapt: times per epoch the task's training texts enter beside the corpus")  # fmt: skip
    parser.add_argument("--teacher", default=DEFAULT_TEACHER, help="the distillation arms' teacher (a model folder)")
    add_report_driver_arguments(parser, "recipes", "Cache/recipes")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, loop_argv, finetune_argv = parse_driver_argv(parser, argv)
    folder = cache_path(args.runs_dir) / args.name
    with usage_errors(parser):  # every check before the first run starts
        budget = one_budget(args.tokens, "each arm's schedule ends at it")
        arms = parse_choices(args.arms, "--arms", ARMS)
        architectures = parse_choices(args.architectures, "--architectures", ARCHITECTURES)
        tasks = planned_tasks(args)
        if not tasks:
            raise ValueError("--tasks: name at least one task")
        if not args.task_weight > 0:
            raise ValueError(f"--task_weight {args.task_weight}: give a positive number of times per epoch")
        refuse_driver_flags(loop_argv, DRIVER_FLAGS, "pretraining arguments", "per arm by the recipes driver")
        teacher = str(cache_path(args.teacher))
        if set(arms) & set(DISTILL_ARMS) and (problem := model_folder_problem(teacher)):
            raise ValueError(f"--teacher: {problem}; make reference fetches the default teacher, or leave the "
                             f"distillation arms out (--arms {','.join(a for a in ARMS if a not in DISTILL_ARMS)})")  # fmt: skip
        plans = {}  # (architecture, arm, task or None) → (plan, run_dir); tapt pretrains once per task
        for architecture in architectures:
            for arm in arms:
                for task in tasks if arm == "tapt" else [tasks[0]]:
                    extra = arm_arguments(arm, args.corpus, task, args.task_weight, teacher)
                    tag = f"{arm}-{safe_name(task)}" if arm == "tapt" else arm
                    plans[architecture, arm, task if arm == "tapt" else None] = plan_architecture(
                        architecture, [budget], [*loop_argv, *extra], f"{args.name}-{tag}", args.num_processes
                    )
        for task in tasks:  # the task must load, and no arm read its held-out texts, before hours of pretraining
            datasets = [plan.loop_args[1].dataset for (_, _, own), (plan, _) in plans.items() if own in (None, task)]
            check_finetune_argv(finetune_argv, task, datasets, "recipes")
        request = {"tokens": budget, "tasks": tasks, "arms": arms, "architectures": architectures,
                   "corpus": args.corpus, "task_weight": args.task_weight, "teacher": teacher,
                   "finetune_args": finetune_argv, "pretrain_args": loop_argv, "num_processes": args.num_processes}  # fmt: skip
        check_report_dir(args.report_dir)  # before the request is recorded: a refusal leaves nothing behind
        check_reuse(folder, request, list(plans.values()), noun="point folder", folder_flag="--runs_dir")
    lock = exclusive(folder, f"recipes {args.name}")
    if lock is None:
        return 1
    rows = []
    with holding(lock) as outcome:
        for (_, arm, _), (plan, run_dir) in plans.items():
            print(f"pretraining {plan.run_name} ({arm}): {plan.tokens(plan.steps[-1]):,} tokens", flush=True)
            pretrain(plan, run_dir, args.num_processes)
        for task in tasks:
            points = PointFolder(folder / "tasks" / safe_name(task), task, finetune_argv, args.num_processes)
            for (architecture, arm, own_task), (plan, run_dir) in plans.items():
                if own_task not in (None, task):
                    continue
                model = last_snapshot(plan, run_dir)
                measured = {}
                for kind, key, extra in (("pretrained", f"{architecture}-{arm}", []),
                                         ("twin", f"{architecture}-twin-{tokenizer_digest(model)}", ["--from_scratch"])):  # fmt: skip
                    what = f"{'from-scratch twin' if kind == 'twin' else arm}, fine-tuning and probes on {task}"
                    measured[kind] = points.reused_or_measured(key, str(model), extra, {"kind": kind, "arm": arm}, what)
                pretrained, twin = summary_row(measured["pretrained"], task), summary_row(measured["twin"], task)
                summary = json.loads((run_dir / "summary.json").read_text())
                rows.append({"task": task, "architecture": architecture, "arm": arm, **pretrained, "twin": twin,
                             **compare(pretrained, twin), "tokens_seen": summary["tokens_seen"],
                             "eval_loss": summary.get("eval_loss"),
                             "unigram_ratio": summary.get("eval_accuracy_over_unigram"), "model": str(model)})  # fmt: skip
            if task != tasks[-1]:  # hours may pass before the next task's report: this one's rows now
                report_rows(rows, args, budget, final=False)
    if outcome.failed:  # a run failed: finished runs and points stay, the same command continues
        return 1
    report_rows(rows, args, budget, final=True)
    return 0


def planned_tasks(args) -> list[str]:
    return [t.strip() for t in args.tasks.split(",") if t.strip()]


def report_rows(rows: list[dict], args, tokens: int, final: bool) -> None:
    """The report of the rows measured so far (after each task; the last one holds every task), printed."""
    baselines = {r["task"]: {"tfidf": r["tfidf"], "majority": r["majority"]} for r in rows}
    goals = goal_lines(rows, planned_tasks(args), cache_path(args.teacher) == cache_path(DEFAULT_TEACHER))
    report = {"title": f"Pretraining recipes at {args.tokens} tokens ({args.name}){'' if final else ', so far'}",
              "tokens": tokens, "rows": rows, "baselines": baselines, "goals": goals, "complete": final}  # fmt: skip
    print_report(write_report_files(report, args.report_dir, "recipes", format_markdown, plot),
                 f"report{'' if final else ' so far'}")  # fmt: skip


if __name__ == "__main__":
    from ..common.entry import run_tool

    sys.exit(run_tool(main, "python -m concept_encoder recipes"))
