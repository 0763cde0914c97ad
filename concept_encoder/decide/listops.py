"""ListOps from scratch and self-pretrained, against the published Long Range Arena table.

    python -m concept_encoder listops --presets micro,tiny --concepts 16,32,64,128 --seeds 3
    make listops LISTOPS_TASK=listops:500 LISTOPS_ARGS="--presets micro"     (a shorter variant)
    python -m concept_encoder listops --jobs 2       (two from-scratch arms at a time, the cores split between them)
    python -m concept_encoder listops --archive docs/measured/listops   (points kept under version control too)

Arms, each fine-tuned by `loops/finetune.py` under the fair protocol (rate and step chosen on dev, the test split
reported once at the dev-chosen step and at the last step, `--bucket_by_length`), each a point of a `PointFolder`
folder (`Cache/listops/<name>/`, resumable: a finished arm is reused, an interrupted one resumes from its
checkpoint, saved every `--save_steps`):

- per preset, from scratch: the Concept Encoder at each width C of `--concepts`, without and with token
  refinement (`--refinement`), without and with the local token mixer (`--mixers none,conv`: `local_mixer`,
  placed once before the first layer; docs/model.md), and BERT of the same shape (full attention through SDPA). The preset's own C is a
  main row (`--seeds` seeds); the other widths are the width sweep (`--sweep_seeds`, 1 by default);
- self-pretrained (`--pretrain_tokens` > 0): `loops/mlm.py` on the task's own training inputs (`--dataset
  task:<task>`, `--mlm_probability 0.1`, one example per sequence) for the first preset's best from-scratch
  Concept Encoder (by dev accuracy) and for BERT, then fine-tuned the same way (`--seeds` seeds).

The report (`Cache/reports/listops_<time>.{md,json,png}`) has test accuracy ± std at the dev-chosen and last
step, the best-dev steps, training wall-clock and tokens/s, peak memory, forward FLOPs per example, parameters,
accuracy by tree depth and length, TF-IDF, the majority class and the root-operator rule (`root_operator_rule`),
and the published numbers beside them.
Everything after `--` goes to the pretraining runs (loops/mlm.py); `--finetune_args` to every fine-tuning.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from ..accounting.flops import classifier_forward_flops
from ..common.paths import cache_path
from ..common.report_files import check_report_dir
from ..constants import ARCHITECTURES
from ..data.tokenizer import load_tokenizer
from ..model.constants import LOCAL_MIXERS
from ..model.presets import PRESETS
from ..tasks.arguments import is_listops
from ..tasks.listops import listops_splits, parse_listops, root_operator_rule
from .experiments import (
    PointFolder,
    add_archive_argument,
    add_jobs_argument,
    add_report_driver_arguments,
    check_archive,
    check_finetune_argv,
    check_jobs,
    check_reuse,
    chosen_runs,
    exclusive,
    given_flags,
    given_or_default,
    holding,
    measure_at_once,
    one_budget,
    parse_choices,
    parse_driver_argv,
    parse_list,
    percent,
    plan_architecture,
    point_config,
    pretrain,
    print_report,
    refuse_driver_flags,
    scratch_model,
    usage_errors,
    write_report_files,
)

# Test accuracy (%) on LRA ListOps: the LRA leaderboard (Tay et al. 2020), Luna (Ma et al. 2021), and the tiny
# configuration of our `micro` shape in the PyTorch reproduction of mlpen/Nystromformer.
PUBLISHED = [
    ("Transformer (LRA)", 36.37), ("Reformer", 37.27), ("Synthesizer", 36.99), ("BigBird", 36.05),
    ("Linformer", 35.70), ("Longformer", 35.63), ("Sinkhorn", 33.67), ("Performer", 18.01),
    ("Linear Transformer", 16.13), ("Local attention", 15.82), ("Luna-256", 37.98),
    ("Transformer, micro shape (Nyströmformer repo)", 37.10), ("Nyströmformer, micro shape", 37.15),
    ("Linformer, micro shape", 37.25),
]  # fmt: skip
GOAL_ACCURACY = 0.37
GOAL_TIME_RATIO = 1 / 3
GOAL_PRETRAINING_LIFT = 0.05
DRIVER_FINETUNE_FLAGS = ("--seeds", "--pooling", "--bucket_by_length", "--report_last_step", "--max_seq_length")
FINETUNE_DEFAULTS = {"--max_steps": "5000", "--per_device_train_batch_size": "32", "--learning_rates": "1e-4,3e-4",
                     "--save_steps": "500"}  # fmt: skip
PRETRAIN_FLAGS = ("--dataset", "--tokenizer", "--max_seq_length", "--preset", "--concept_num", "--token_refinement",
                  "--packing", "--local_mixer")  # fmt: skip


@dataclass
class Arm:
    """One fine-tuned model: what it is, how many seeds, and whether it is the width sweep or a main row."""

    key: str
    label: str
    preset: str
    architecture: str  # concept or bert
    concept_num: int | None
    refine: bool
    pooling: str
    seeds: int
    kind: str  # scratch | sweep | pretrained
    mixer: str = "none"  # the Concept Encoder's local_mixer (BERT: none)


def scratch_arms(args) -> list[Arm]:
    """The from-scratch arms in the order they run: per preset, each width without then with refinement, each
    without then with the mixer, then BERT; every pooling of `--poolings` an arm has (a Concept Encoder pools `cls`
    only when it refines). Arms without the mixer keep the keys they had before `--mixers` existed."""
    arms = []
    for preset in args.preset_list:
        own = PRESETS[preset]["concept_num"]
        for concepts in args.concept_list if "concept" in args.architecture_list else []:
            for refine in args.refine_list:
                for mixer in args.mixer_list:
                    for pooling in args.pooling_list:
                        if pooling == "cls" and not refine:
                            continue
                        main = concepts == own
                        suffix = (f"{'-refine' if refine else ''}{'' if mixer == 'none' else '-' + mixer}"
                                  f"{'' if pooling == 'mean' else '-' + pooling}")  # fmt: skip
                        label = (f"Concept Encoder {preset}, C={concepts}{', refined tokens' if refine else ''}"
                                 f"{', local mixer' if mixer != 'none' else ''}, {pooling} pooling")  # fmt: skip
                        arms.append(Arm(f"{preset}-concept-C{concepts}{suffix}", label, preset, "concept", concepts,
                                        refine, pooling, args.seeds if main else args.sweep_seeds,
                                        "scratch" if main else "sweep", mixer))  # fmt: skip
        for pooling in args.pooling_list if "bert" in args.architecture_list else []:
            arms.append(Arm(f"{preset}-bert{'' if pooling == 'mean' else '-' + pooling}",
                            f"BERT {preset}, full attention, {pooling} pooling", preset, "bert", None, False, pooling,
                            args.seeds, "scratch"))  # fmt: skip
    return arms


def fresh_folder(folder: Path, arm: Arm, tokenizer, positions: int) -> Path:
    """`folder/models/<arm>`: the arm's config and the ListOps tokenizer (no weights: fine-tuning builds them
    from the seed, `--from_scratch`)."""
    return scratch_model(
        folder / "models" / arm.key, arm.architecture, arm.preset, positions, tokenizer,
        concept_num=arm.concept_num, token_refinement=arm.refine, classifier_pooling=arm.pooling,
        **({"local_mixer": arm.mixer} if arm.architecture == "concept" else {}),
    )  # fmt: skip


def finetune_extra(arm: Arm, max_seq_length: int) -> list[str]:
    extra = ["--seeds", str(arm.seeds), "--pooling", arm.pooling, "--bucket_by_length", "true",
             "--report_last_step", "true", "--max_seq_length", str(max_seq_length)]  # fmt: skip
    return extra + (["--from_scratch"] if arm.kind != "pretrained" else [])


def with_defaults(finetune_argv: list[str]) -> list[str]:
    """The fine-tuning arguments with the driver's defaults for what was not given (5K steps of 32, LRA's tiny
    configuration; two rates; a checkpoint every 500 steps; dev evaluated 20 times a run)."""
    argv = given_or_default(finetune_argv, FINETUNE_DEFAULTS)
    if not given_flags(finetune_argv, ("--eval_steps",)):  # --max_steps is in argv now: given, or the default
        argv += ["--eval_steps", str(max(1, int(argv[argv.index("--max_steps") + 1]) // 20))]
    return argv


def twin_candidates(arms: list[Arm], args) -> tuple[list[Arm], list[Arm]]:
    """The from-scratch arms a self-pretrained twin may copy: the first preset's main Concept Encoder arms (the
    twin is the one best on dev) and its first BERT arm."""
    first = [a for a in arms if a.preset == args.preset_list[0] and a.kind != "sweep"]
    return [a for a in first if a.architecture == "concept"], [a for a in first if a.architecture == "bert"][:1]


def selfpre_arm(twin: Arm, args) -> Arm:
    """The self-pretrained twin of from-scratch arm `twin`: the same model, pretrained on the task's inputs."""
    return Arm(f"{twin.key}-selfpre", f"{twin.label}, self-pretrained", twin.preset, twin.architecture,
               twin.concept_num, twin.refine, twin.pooling, args.seeds, "pretrained", twin.mixer)  # fmt: skip


def pretraining_plan(arm: Arm, args, loop_argv: list[str], max_seq_length: int, budget: int):
    """The self-pretraining run of `arm`'s model: MLM on the task's training inputs at 10% masking."""
    argv = [*loop_argv, "--dataset", f"task:{args.task}", "--tokenizer", "listops", "--packing", "false",
            "--max_seq_length", str(max_seq_length), "--preset", arm.preset]  # fmt: skip
    if "--mlm_probability" not in given_flags(loop_argv, ("--mlm_probability",)):
        argv += ["--mlm_probability", "0.1"]
    if arm.architecture == "concept":
        argv += ["--concept_num", str(arm.concept_num), "--token_refinement", str(arm.refine).lower(),
                 "--local_mixer", arm.mixer]  # fmt: skip
    return plan_architecture(arm.architecture, [budget], argv, f"{args.name}-selfpre-{arm.key}", args.num_processes,
                             "--pretrain_tokens")  # fmt: skip


def arm_row(point: dict, arm: Arm, tokens: float) -> dict:
    """One report row from an arm's point: test accuracy at the dev-chosen and last step, cost, breakdowns
    (`tokens`: the mean input length, [CLS] and [SEP] included)."""
    row, chosen = chosen_runs(point)
    seconds = statistics.fmean(r["seconds"] for r in chosen) if chosen else None
    steps = chosen[0]["steps"] if chosen else None
    batch = chosen[0]["settings"]["per_device_train_batch_size"] * chosen[0]["settings"]["world_size"] if chosen else 0
    config = point_config(point)
    config.setdefault("num_labels", 10)
    config["classifier_pooling"] = arm.pooling
    memory = [r.get("memory", {}) for r in chosen]
    peak = max((m.get("cuda_peak_allocated_gb") or m.get("peak_rss_gb") or 0 for m in memory), default=None)
    return {"key": arm.key, "label": arm.label, "kind": arm.kind, "preset": arm.preset,
            "architecture": arm.architecture, "concept_num": arm.concept_num, "refine": arm.refine,
            "mixer": arm.mixer, "pooling": arm.pooling, "seeds": row["seeds"], "accuracy": row["accuracy_mean"],
            "accuracy_std": row["accuracy_std"], "accuracy_last": row.get("last_step_accuracy_mean"),
            "accuracy_last_std": row.get("last_step_accuracy_std"), "best_steps": row["best_steps"],
            "steps": steps, "learning_rate": row["learning_rate"], "seconds": seconds,
            "tokens_per_s": steps * batch * tokens / seconds if seconds else None,
            "peak_memory_gb": peak, "memory_kind": "CUDA peak allocated" if any(
                "cuda_peak_allocated_gb" in m for m in memory) else "process peak RSS",
            "forward_flops_per_example": classifier_forward_flops(config, round(tokens)),
            "parameters": row.get("parameters"), "accuracy_by": row.get("accuracy_by"),
            "still_improving": row.get("still_improving")}  # fmt: skip


def goal_lines(rows: list[dict], preset: str, root_rule: float, test_examples: int) -> list[str]:
    """The issue's goals, each met or missed, from the first preset's rows; and which rows cross the root-operator
    rule by more than the noise (their seeds' spread, and at least two binomial standard errors of a test split of
    `test_examples`): a model that does not has not shown it reads past the first symbol."""
    main = {r["key"]: r for r in rows if r["preset"] == preset}
    concept = [r for r in main.values() if r["architecture"] == "concept" and r["kind"] == "scratch"]
    bert = next((r for r in main.values() if r["architecture"] == "bert" and r["kind"] == "scratch"), None)
    lines = []
    if concept and bert:
        best = max(concept, key=lambda r: r["accuracy"])
        at_bert = best["accuracy"] + best["accuracy_std"] >= bert["accuracy"] - bert["accuracy_std"]
        met = best["accuracy"] >= GOAL_ACCURACY and at_bert
        ratio = best["seconds"] / bert["seconds"] if best["seconds"] and bert["seconds"] else None
        lines.append(f"- Concept Encoder {preset} ({best['key']}) {100 * best['accuracy']:.2f}% against BERT's "
                     f"{100 * bert['accuracy']:.2f}% (goal: >= 37% and BERT's level within the seeds' spread): "
                     f"{'met' if met else 'missed'}")  # fmt: skip
        if ratio is not None:
            lines.append(f"- its training time {ratio:.2f}x BERT's (goal <= {GOAL_TIME_RATIO:.2f}): "
                         f"{'met' if ratio <= GOAL_TIME_RATIO else 'missed'}")  # fmt: skip
    by_key = {r["key"]: r for r in rows}
    for pre in [r for r in rows if r["kind"] == "pretrained"]:
        if twin := by_key.get(pre["key"].removesuffix("-selfpre")):
            lift = pre["accuracy"] - twin["accuracy"]
            lines.append(f"- self-pretraining {pre['key']}: {100 * lift:+.2f} points over its from-scratch twin "
                         f"(goal >= +5): {'met' if lift >= GOAL_PRETRAINING_LIFT else 'missed'}")  # fmt: skip
    noise = 2 * math.sqrt(root_rule * (1 - root_rule) / max(1, test_examples))
    above = [r["key"] for r in rows if r["accuracy"] - root_rule > max(r["accuracy_std"], noise)]
    lines.append(f"- above the root-operator rule ({100 * root_rule:.2f}%) by more than their seeds' spread and "
                 f"{100 * noise:.1f} points (two standard errors of {test_examples:,} test trees): "
                 f"{', '.join(above) or 'none'}")  # fmt: skip
    return lines


def format_markdown(report: dict) -> str:
    lines = [f"# ListOps: {report['task']}", "", report["settings_line"], "",
             "Run s/seed: a fine-tuning run's wall-clock at the chosen rate, dev evaluations included; tokens/s: its "
             "training tokens (steps x batch x mean input) over that time.", "",
             "| arm | seeds | test acc. (dev-chosen step) | test acc. (last step) | best-dev steps | run s/seed | "
             "tokens/s | peak GB | forward GFLOP/example | parameters |", "|" + "---|" * 10]  # fmt: skip
    for r in report["rows"]:
        lines.append(f"| {r['label']}{' (width sweep)' if r['kind'] == 'sweep' else ''} | {len(r['seeds'])} | "
                     f"{percent(r['accuracy'], r['accuracy_std'])} | {percent(r['accuracy_last'], r['accuracy_last_std'])} | "
                     f"{', '.join(map(str, r['best_steps']))} / {r['steps']} | {r['seconds'] or 0:.0f} | "
                     f"{r['tokens_per_s'] or 0:,.0f} | {r['peak_memory_gb'] or 0:.2f} | "
                     f"{r['forward_flops_per_example'] / 1e9:.3f} | {r['parameters'] or 0:,} |")  # fmt: skip
    base = report["baselines"]
    lines += ["", f"Baselines on test: majority class {percent(base['majority'])}, TF-IDF (symbol 1-2 grams) + "
              f"linear {percent(base['tfidf'])}, the root-operator rule (the value most frequent under the root "
              f"operator: what a model that reads only the first symbol scores) {percent(base['root_rule'])}. Peak "
              f"memory is the {report['rows'][0]['memory_kind']}." if report["rows"] else "", "", "## Published test accuracy (%)", "",
              "| model | accuracy |", "|---|---|", *(f"| {n} | {a:.2f} |" for n, a in PUBLISHED)]  # fmt: skip
    lines += ["", "## Accuracy by tree depth and length (test, mean over seeds)", ""]
    for r in report["rows"]:
        for name, groups in (r.get("accuracy_by") or {}).items():
            cells = ", ".join(f"{g}: {100 * a:.1f}" for g, a in groups.items())
            lines.append(f"- {r['key']}, by {name}: {cells}")
    lines += ["", "## Goals", "", *report["goals"]]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    figure, (bars, widths) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 2]})
    names = [r["key"] for r in rows]
    bars.bar(range(len(rows)), [100 * r["accuracy"] for r in rows],
             yerr=[100 * r["accuracy_std"] for r in rows], color=["C0" if r["architecture"] == "concept" else "C1"
                                                                  for r in rows])  # fmt: skip
    bars.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=7)
    base = report["baselines"]
    for value, label, style in ((36.37, "Transformer (LRA)", "--"), (100 * base["majority"], "majority", ":"),
                                (100 * base["tfidf"], "TF-IDF", "-."), (100 * base["root_rule"], "root rule", "-")):  # fmt: skip
        bars.axhline(value, linestyle=style, color="grey", linewidth=1)
        bars.text(len(rows) - 0.5, value, label, fontsize=7, ha="right", va="bottom")
    bars.set_ylabel("test accuracy (%) at the dev-chosen step")
    for preset in dict.fromkeys(r["preset"] for r in rows):
        for refine, mixer in ((False, "none"), (True, "none"), (False, "conv"), (True, "conv")):
            points = sorted((r["concept_num"], 100 * r["accuracy"]) for r in rows if r["preset"] == preset
                            and r["architecture"] == "concept" and r["refine"] == refine and r["kind"] != "pretrained"
                            and r["pooling"] == "mean" and r.get("mixer", "none") == mixer)  # fmt: skip
            if points:
                label = f"{preset}{', refined tokens' if refine else ''}{', local mixer' if mixer != 'none' else ''}"
                widths.plot(*zip(*points, strict=True), marker="o", label=label)
    widths.axhline(100 * base["root_rule"], linestyle="-", color="grey", linewidth=1, label="root-operator rule")
    widths.set_ylim(0, max([45.0, *(100 * r["accuracy"] + 5 for r in rows)]))
    widths.set_xscale("log", base=2)
    widths.set_xlabel("concepts C")
    widths.set_ylabel("test accuracy (%)")
    widths.set_title("the bottleneck's width")
    if widths.lines:
        widths.legend(fontsize=8)
    figure.suptitle(f"ListOps ({report['task']}): from scratch and self-pretrained")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m concept_encoder listops",
        description="LRA ListOps: the Concept Encoder at several widths, with and without token refinement, "
                    "against BERT of the same shape, from scratch and self-pretrained, beside the published table.",
        epilog="Everything after `--` goes to the self-pretraining runs (loops/mlm.py); the driver sets --dataset, "
               "--tokenizer, --packing, --max_seq_length, --preset, --concept_num, --token_refinement, --local_mixer.",
    )  # fmt: skip
    parser.add_argument("--task", default="listops", help="listops, or listops:<max_length>[:<train>] (shorter)")
    parser.add_argument("--architectures", default="concept,bert",
                        help="concept and/or bert (BERT's full attention at 2,000 tokens: hours a run on a CPU)")  # fmt: skip
    parser.add_argument("--presets", default="micro,tiny", help="model shapes, comma-separated (the first is main)")
    parser.add_argument("--concepts", default="16,32,64,128", help="the Concept Encoder's widths C")
    parser.add_argument("--refinement", default="both", choices=("off", "on", "both"), help="token refinement arms")
    parser.add_argument("--mixers", default="none", help="the Concept Encoder's local mixer arms: none and/or conv")
    parser.add_argument("--poolings", default="mean", help="mean and/or cls, comma-separated")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the main rows")
    parser.add_argument("--sweep_seeds", type=int, default=1, help="seeds of the width sweep's other widths")
    parser.add_argument("--pretrain_tokens", default="20M", help="self-pretraining budget per model (0: none)")
    add_jobs_argument(parser, "arms")
    add_archive_argument(parser, "driver", "docs/measured/listops")
    add_report_driver_arguments(parser, "listops", "Cache/listops")
    return parser


def check_arguments(args) -> None:
    """Every argument checked before anything runs (ValueError naming it)."""
    if not is_listops(args.task):
        raise ValueError(f"--task {args.task!r}: the driver measures listops or listops:<max_length>[:<train>]")
    parse_listops(args.task)
    args.architecture_list = parse_choices(args.architectures, "--architectures", ARCHITECTURES)
    args.preset_list = parse_choices(args.presets, "--presets", sorted(PRESETS))
    args.concept_list = parse_list(args.concepts, "--concepts", int)
    if any(c < 1 for c in args.concept_list):
        raise ValueError(f"--concepts {args.concepts!r}: widths are whole numbers >= 1")
    args.refine_list = {"off": [False], "on": [True], "both": [False, True]}[args.refinement]
    args.mixer_list = parse_choices(args.mixers, "--mixers", LOCAL_MIXERS)
    args.pooling_list = parse_choices(args.poolings, "--poolings", ("mean", "cls"))
    if args.seeds < 1 or args.sweep_seeds < 1:
        raise ValueError("--seeds and --sweep_seeds must be >= 1")
    args.pretrain_budget = (
        0 if args.pretrain_tokens.strip() in ("0", "")
        else one_budget(args.pretrain_tokens, "each self-pretrained twin reads it", "--pretrain_tokens")
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, loop_argv, finetune_argv = parse_driver_argv(parser, argv)
    folder = cache_path(args.runs_dir) / args.name
    with usage_errors(parser):  # every check before the first run starts
        check_arguments(args)
        check_jobs(args)
        refuse_driver_flags(finetune_argv, DRIVER_FINETUNE_FLAGS, "--finetune_args:", "by the listops driver")
        refuse_driver_flags(loop_argv, PRETRAIN_FLAGS, "pretraining arguments", "by the listops driver")
        finetune_argv = with_defaults(finetune_argv)
        max_seq_length = parse_listops(args.task).max_length + 2  # [CLS] … [SEP]
        check_finetune_argv(
            [*finetune_argv, "--max_seq_length", str(max_seq_length)], args.task, (), "listops"
        )  # generates it
        arms = scratch_arms(args)
        if not arms:
            raise ValueError(f"--architectures {args.architectures} --refinement {args.refinement} --poolings "
                             f"{args.poolings}: no arm to measure (a Concept Encoder pools cls only when it refines)")  # fmt: skip
        candidates = [arm for group in twin_candidates(arms, args) for arm in group] if args.pretrain_budget else []
        for twin in candidates:  # each twin's pretraining plan checked now, not after hours of fine-tuning
            pretraining_plan(selfpre_arm(twin, args), args, loop_argv, max_seq_length, args.pretrain_budget)
        request = {"task": args.task, "arms": [a.key for a in arms], "seeds": args.seeds,
                   "sweep_seeds": args.sweep_seeds, "pretrain_tokens": args.pretrain_budget,
                   "finetune_args": finetune_argv, "pretrain_args": loop_argv, "num_processes": args.num_processes}  # fmt: skip
        archive = cache_path(args.archive) / args.name if args.archive else None
        if archive:  # its points become this folder's: the same request only
            check_archive(archive, request, noun="archived point folder")
        check_report_dir(args.report_dir)  # before the request is recorded: a refusal leaves nothing behind
        check_reuse(folder, request, [], noun="point folder", folder_flag="--runs_dir")
    tokenizer = load_tokenizer("listops")
    point_folder = PointFolder(folder, args.task, finetune_argv, args.num_processes, probe=False, archive=archive)
    if restored := point_folder.restore():
        print(f"{', '.join(restored)} restored from {archive}", flush=True)
    lock = exclusive(folder, f"listops {args.name}")
    if lock is None:
        return 1
    points = {}
    with holding(lock) as outcome:
        jobs = [functools.partial(point_folder.reused_or_measured, arm.key,
                                  str(fresh_folder(folder, arm, tokenizer, max_seq_length)),
                                  finetune_extra(arm, max_seq_length), {"arm": arm.__dict__},
                                  f"[{index}/{len(arms)}] {arm.label}")
                for index, arm in enumerate(arms, 1)]  # fmt: skip
        pending = sum(not point_folder.done(arm.key) for arm in arms)
        points.update(zip([arm.key for arm in arms], measure_at_once(jobs, args, "arms", pending), strict=True))
        if args.pretrain_budget:
            concept, bert = twin_candidates(arms, args)
            twins = [max(concept, key=lambda a: dev_accuracy(points[a.key]))] if concept else []  # chosen on dev
            for twin in twins + bert:
                arm = selfpre_arm(twin, args)
                plan, run_dir = pretraining_plan(arm, args, loop_argv, max_seq_length, args.pretrain_budget)
                extra = finetune_extra(arm, max_seq_length)
                if point_folder.finished(arm.key, extra) is None:  # one measured (or restored) needs no model
                    print(f"self-pretraining {plan.run_name}: {plan.tokens(plan.steps[-1]):,} tokens", flush=True)
                    pretrain(plan, run_dir, args.num_processes)
                arms.append(arm)
                points[arm.key] = point_folder.reused_or_measured(
                    arm.key, str(run_dir / "final"), extra, {"arm": arm.__dict__}, f"{arm.label}: fine-tuning"
                )
    if outcome.failed:  # a run failed: finished arms stay, the same command continues
        return 1
    splits = listops_splits(args.task)  # read once: about 250 MB of JSON lines at full size
    tokens = statistics.fmean(row["length"] for row in splits["train"]) + 2  # [CLS] and [SEP]
    rows = [arm_row(points[a.key], a, tokens) for a in arms]
    baselines = next(iter(points.values()))["baselines"][args.task]
    base = {"majority": baselines["majority"]["accuracy"], "tfidf": baselines["tfidf"]["validation"]["accuracy"],
            "root_rule": root_operator_rule(splits)["test"]}  # fmt: skip
    report = {"task": args.task, "rows": rows, "baselines": base, "published": PUBLISHED,
              "goals": goal_lines(rows, args.preset_list[0], base["root_rule"], len(splits["test"])),
              "mean_tokens": tokens,
              "settings_line": f"Fine-tuning: {' '.join(finetune_argv)}; mean input {tokens:.0f} tokens; test = the "
                               "task's test split, read once per seed at the step chosen on dev."}  # fmt: skip
    print_report(write_report_files(report, args.report_dir, "listops", format_markdown, plot))
    return 0


def dev_accuracy(point: dict) -> float:
    """The mean dev accuracy of a point's fine-tuning runs at their chosen rate (what picks the best arm)."""
    chosen = chosen_runs(point)[1]
    return statistics.fmean(r["dev"]["accuracy"] for r in chosen) if chosen else 0.0


if __name__ == "__main__":
    from ..common.entry import run_tool

    sys.exit(run_tool(main, "python -m concept_encoder listops"))
