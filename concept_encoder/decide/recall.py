"""Associative recall's capacity map: test accuracy against the number of key-value pairs K, for the Concept
Encoder at several widths C, without and with the local token mixer, beside BERT of the same shape.

    python -m concept_encoder recall                         (the map: K 4..128, C 16..128, both mixers, BERT)
    python -m concept_encoder recall --report_only           (the report of the cells finished so far)
    python -m concept_encoder recall --archive docs/measured/recall   (points kept under version control too)
    python -m concept_encoder recall --placements first,every         (the mixer once, and before every layer)
    python -m concept_encoder recall --jobs 2                         (two cells at a time: 1.57x the steps on 2 cores)
    python -m concept_encoder recall --starts scratch,4               (also each K > 4 from its K = 4 cell's models)
    make recall RECALL_ARGS="--pairs 4,8 --concepts 16"      (a smaller map)

Each cell is one model fine-tuned from scratch by `loops/finetune.py` on `recall:<K>` under the fair protocol (its
rate chosen on dev from `--learning_rates`, the test split read once per seed at the step chosen on dev), a point
of the point folder `Cache/recall/<name>-K<K>/` (resumable: a finished cell is reused, an interrupted one resumes
from its checkpoint). The main cells (C in `--main_concepts`, K in `--main_pairs`, and BERT at those K) run
`--seeds` seeds; the others one (`--sweep_seeds`), marked in the report. K above `--keys` draws its keys from K
symbols (a key appears once an example), marked too.

`--starts` adds a curriculum: with a K0 in it (`--starts scratch,4`), every cell at K > K0 is measured a second time,
each seed fine-tuned not from scratch but from its K0 cell's model of the same seed (the rate chosen on dev as
everywhere; cells `<cell>-from<K0>`, their own rows, heat-map panel and goal line). Binding learned where the jump
comes early (K = 4) carries to K = 32 within a few hundred steps where from scratch no seed binds (docs/results.md).

Why it is the right measurement: the task is binding and nothing else. The value most frequent in the example
(`tasks.recall.no_binding_line`) is what a model scores without binding any key to its value; chance is 1/values.
A fixed state of C concepts of width H must hold K pairs, so accuracy should fall with K past what it holds
(Zoology, Arora et al. 2023: attention solves multi-query recall at every K it was given; fixed-state models do
not). The report (`Cache/reports/recall_<time>.{md,json,png}`): the table, a heat map per mixer (accuracy over C
and K), accuracy against K with the no-binding line, each cell's wall-clock, and the issue's goals met or missed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from ..checkpoints.model_folder import model_folder_problem
from ..common.cli_types import at_least
from ..common.paths import cache_path
from ..common.report_files import check_report_dir
from ..constants import ARCHITECTURES
from ..data.recall_vocab import KEYS, VALUES, example_tokens
from ..data.tokenizer import load_tokenizer
from ..finetuning.report import grid_edge
from ..model.constants import LOCAL_MIXER_PLACEMENTS, LOCAL_MIXERS
from ..model.presets import PRESETS
from ..tasks.arguments import TaskArguments
from ..tasks.recall import RecallSettings, no_binding_line, parse_recall, recall_splits
from ..training.args import PER_SEED
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
    given_or_default,
    holding,
    measure_at_once,
    parse_choices,
    parse_driver_argv,
    parse_list,
    percent,
    print_report,
    refuse_driver_flags,
    scratch_model,
    usage_errors,
    write_report_files,
)

GOAL_ACCURACY = 0.95  # the mixer at C = 64 holds this up to K = 32 (issue 54)
GOAL_CONCEPTS, GOAL_PAIRS = 64, 32
MAIN_CONCEPTS, MAIN_PAIRS = "16,64", "4,8,16,32"  # 3 seeds (--seeds) on these, one elsewhere (issue 54)
MAP_FOLDER = {"noun": "map", "folder_flag": "--runs_dir"}  # what check_reuse's messages call a K's folder
DEFAULT_MAX_SEQ_LENGTH = TaskArguments.__dataclass_fields__["max_seq_length"].default  # fine-tuning's
DRIVER_FINETUNE_FLAGS = ("--seeds", "--pooling", "--from_scratch", "--report_last_step", "--max_seq_length")
# 18,000 steps of 64, ended early once dev accuracy reaches 99.5%: binding arrives as a sudden jump whose timing
# follows the schedule (a longer schedule keeps the rate high for longer): C = 64 with the mixer at K = 8 was at
# 44.7% when a 6,000-step schedule ended and jumped at step 5,500 of an 18,000-step one (docs/results.md). A run
# that binds stops there (`--stop_at_dev`), so the long schedule costs only the runs that never bind.
FINETUNE_DEFAULTS = {"--max_steps": "18000", "--per_device_train_batch_size": "64", "--learning_rates": "1e-3,3e-3",
                     "--eval_steps": "500", "--save_steps": "1000", "--stop_at_dev": "0.995"}  # fmt: skip


@dataclass
class Cell:
    """One fine-tuned model of the map: which architecture, width, mixer (and where it acts) and K, and how many
    seeds."""

    pairs: int
    architecture: str  # concept or bert
    concept_num: int | None
    mixer: str  # none or conv (BERT: none)
    seeds: int
    main: bool
    keys: int
    placement: str = "first"  # the conv mixer once before the first layer, or before every layer (`every`)
    start: int | None = None  # from scratch, or (a curriculum) from the cell at this K, each seed from its own model

    @property
    def key(self) -> str:
        """The point's name inside its K's point folder (`C64-conv`; `C64-conv-every` for the mixer before every
        layer: the maps measured before the placement axis keep their names; `C64-conv-from4` from the K = 4 cell)."""
        key = "bert" if self.architecture == "bert" else f"C{self.concept_num}-{self.mixer}"
        key += "-every" if self.architecture != "bert" and self.placement == "every" else ""
        return key + (f"-from{self.start}" if self.start else "")

    @property
    def label(self) -> str:
        mixer = {"none": "", "first": ", local mixer", "every": ", local mixer before every layer"}
        label = ("BERT, full attention" if self.architecture == "bert" else f"Concept Encoder C={self.concept_num}"
                 + mixer["none" if self.mixer == "none" else self.placement])  # fmt: skip
        return label + (f", from its K={self.start} model" if self.start else "")

    @property
    def start_cell(self) -> Cell | None:
        """The cell a curriculum cell starts from: the same model at K = `start`, from scratch (None: this cell
        starts from scratch)."""
        return dataclasses.replace(self, pairs=self.start, start=None) if self.start else None


def cells(args) -> list[Cell]:
    """The map's cells in the order they run: K ascending; at each K every width, mixer and placement (the
    mixer's; none has one cell), then BERT; from scratch first, then from the curriculum's start (`--starts`: its
    K's cells from scratch are always planned, they are what the others start from)."""
    out = []
    for pairs in args.pair_list:
        starts = [None] if "scratch" in args.start_list or pairs == args.curriculum else []
        starts += [args.curriculum] if args.curriculum and pairs > args.curriculum else []
        for start in starts:
            out += cells_at(pairs, start, args)
    return out


def cells_at(pairs: int, start: int | None, args) -> list[Cell]:
    """The cells at K = `pairs` starting from `start` (None: from scratch), in the map's order."""
    out, keys = [], max(args.keys, pairs)
    for concepts in args.concept_list if "concept" in args.architecture_list else []:
        for mixer in args.mixer_list:
            main = concepts in args.main_concept_list and pairs in args.main_pair_list
            seeds = args.seeds if main else args.sweep_seeds
            for placement in ["first"] if mixer == "none" else args.placement_list:
                out.append(Cell(pairs, "concept", concepts, mixer, seeds, main, keys, placement, start))
    if "bert" in args.architecture_list:
        main = pairs in args.main_pair_list
        out.append(Cell(pairs, "bert", None, "none", args.seeds if main else args.sweep_seeds, main, keys,
                        start=start))  # fmt: skip
    return out


def sized_argv(finetune_argv: list[str], pairs: int) -> list[str]:
    """The fine-tuning arguments of K's cells: `--max_seq_length` added where an example is longer than
    fine-tuning's default (K of 63 and more), so no example is cut (the loop refuses a recall task it would cut).
    Named only there: the maps measured before it keep their requests."""
    tokens = example_tokens(pairs)
    return [*finetune_argv, "--max_seq_length", str(tokens)] if tokens > DEFAULT_MAX_SEQ_LENGTH else finetune_argv


def task_name(pairs: int, args) -> str:
    """`recall:<K>` for the published set-up, else the long form naming keys (K at least), values and the training
    size."""
    keys = max(args.keys, pairs)
    train = args.train if args.train is not None else RecallSettings(pairs).train
    if keys == KEYS and args.values == VALUES and train == RecallSettings(pairs).train:  # the defaults, named or not
        return f"recall:{pairs}"
    return f"recall:{pairs}:{keys}:{args.values}:{train}"


def cell_argv(cell: Cell) -> list[str]:
    """The fine-tuning arguments a cell adds to the map's (`extra` of its point: a change re-measures it)."""
    fresh = [] if cell.start else ["--from_scratch"]  # a curriculum cell loads its start's weights, head and all
    return ["--seeds", str(cell.seeds), "--pooling", "mean", *fresh, "--report_last_step", "true"]


def finished_points(plan: list[Cell], root: Path, args, argvs: dict[int, list[str]]) -> dict:
    """`(K, cell key) -> point` for the cells of `plan` finished under these arguments (`argvs`: K's fine-tuning
    arguments); runs nothing."""
    folders = {k: PointFolder(root / f"{args.name}-K{k}", "", argvs[k], args.num_processes,
                              archive=archive_folder(args, k)) for k in args.pair_list}  # fmt: skip
    points = {}
    for cell in plan:
        if point := folders[cell.pairs].finished(cell.key, cell_argv(cell)):
            points[(cell.pairs, cell.key)] = point
            folders[cell.pairs].keep(cell.key)
    return points


def restore_archive(root: Path, args, argvs: dict[int, list[str]]) -> None:
    """The points `--archive` keeps and `--runs_dir` lacks, copied in (each K's archive checked against this
    request before, in `main`); one line a K says which."""
    for pairs in args.pair_list:
        archive = archive_folder(args, pairs)
        folder = PointFolder(root / f"{args.name}-K{pairs}", "", argvs[pairs], args.num_processes, archive=archive)
        if restored := folder.restore():
            print(f"K={pairs}: {', '.join(restored)} restored from {archive}", flush=True)


def model_folder(folder: Path, cell: Cell, preset: str, positions: int, tokenizer) -> Path:
    """`folder/models/<cell>`: the cell's config and the recall tokenizer (no weights: fine-tuning builds them
    from the seed, `--from_scratch`)."""
    return scratch_model(folder / "models" / cell.key, cell.architecture, preset, positions, tokenizer,
                         concept_num=cell.concept_num, local_mixer=cell.mixer, local_mixer_placement=cell.placement,
                         classifier_pooling="mean")  # fmt: skip


def cell_row(point: dict, cell: Cell, line: float) -> dict:
    """One report row from a cell's point: test accuracy at the dev-chosen and last step, the rate chosen, and the
    cell's wall-clock (every run it took: the seeds, and the grid's other rates where the point kept their time)."""
    row, runs = chosen_runs(point)
    grid_runs = len(row["rate_grid"]) - 1 if "grid_seconds" in row else 0  # the grid's other rates, when timed
    return {"key": cell.key, "label": cell.label, "pairs": cell.pairs, "keys": cell.keys,
            "architecture": cell.architecture, "concept_num": cell.concept_num, "mixer": cell.mixer,
            "placement": cell.placement, "start": cell.start, "main": cell.main, "seeds": row["seeds"], "accuracy": row["accuracy_mean"],
            "accuracy_std": row["accuracy_std"], "accuracy_seeds": row.get("accuracy_seeds"),
            "accuracy_last": row.get("last_step_accuracy_mean"),
            "learning_rate": row["learning_rate"], "rate_edge": grid_edge(row), "best_steps": row["best_steps"],
            "still_improving": row.get("still_improving"), "no_binding_line": line,
            "cell_seconds": row["seconds"] + row.get("grid_seconds", 0),
            "runs": len(runs) + grid_runs}  # fmt: skip


def holds(rows: list[dict], concepts: int, mixer: str, up_to: int) -> tuple[bool, list[int]]:
    """Whether the Concept Encoder of width `concepts` with `mixer` holds `GOAL_ACCURACY` at every measured K up
    to `up_to` (and which K were measured)."""
    measured = sorted((r["pairs"], r["accuracy"]) for r in rows if r["architecture"] == "concept"
                      and r["concept_num"] == concepts and mixer_name(r) == mixer and r["pairs"] <= up_to)  # fmt: skip
    return bool(measured) and all(a >= GOAL_ACCURACY for _, a in measured), [k for k, _ in measured]


def capacity_lines(rows: list[dict], pending: dict[str, list[str]]) -> list[str]:
    """Per width and mixer: the largest K held at `GOAL_ACCURACY` before the first K that is not (or is not
    measured yet: `pending`, K -> the models missing there), and that K over C (pairs held per concept): the
    capacity law, where accuracy falls with K. A K held again past the break is named (a one-seed cell can dip)."""
    lines = []
    names = {row_name(r) for r in rows} | {name for names in pending.values() for name in names}
    widths = {name: int(name.split(",")[0].removeprefix("C=")) for name in names if not name.startswith("BERT")}
    for model in sorted(widths, key=lambda name: (widths[name], name)):
        concepts, mixer = widths[model], model.split(", ")[1]
        sequence = sorted([(r["pairs"], r["accuracy"]) for r in rows if row_name(r) == model]
                          + [(int(k), None) for k, models in pending.items() if model in models])  # fmt: skip
        held, stop = 0, len(sequence)
        for index, (pairs, accuracy) in enumerate(sequence):
            if accuracy is None or accuracy < GOAL_ACCURACY:
                stop = index
                break
            held = pairs
        again = [k for k, a in sequence[stop + 1 :] if a is not None and a >= GOAL_ACCURACY]
        name = f"- C={concepts}, mixer {mixer}: "
        if stop == len(sequence):
            lines.append(name + f"holds {GOAL_ACCURACY:.0%} up to K={held} ({held / concepts:.2f} pairs per concept), "
                         "at every K measured")  # fmt: skip
            continue
        (first, accuracy), past = sequence[stop], ""
        row = next((r for r in rows if row_name(r) == model and r["pairs"] == first), {})  # {}: K not measured yet
        some = f" ({solved})" if (solved := seeds_solving(row)) else ""  # seeds the break's mean hides
        if again:  # past a K not measured yet, or a dip (a one-seed cell)
            past = f" ({'held at' if accuracy is None else 'held again at'} K={', '.join(map(str, again))})"
        if held:
            after = f"K={first} not measured yet" if accuracy is None else f"below it from K={first}{some}"
            lines.append(name + f"holds {GOAL_ACCURACY:.0%} up to K={held} ({held / concepts:.2f} pairs per concept), "
                         + after + past)  # fmt: skip
        elif accuracy is None:
            lines.append(name + f"K={first}, its smallest K, not measured yet" + past)
        else:
            lines.append(name + f"below {GOAL_ACCURACY:.0%} from the smallest K measured (K={first}){some}" + past)
    return lines


def pending_ks(pending: dict[str, list[str]], model: str) -> str:
    """`K=4, 8` for the Ks where `model` (a row name, or `, none`: every width without the mixer) is still missing,
    else ''."""
    return ", ".join(str(k) for k in sorted(int(k) for k, ms in pending.items() if any(m.endswith(model) for m in ms)))


def seeds_solving(row: dict) -> str:
    """`solved at 1 of 3 seeds: 100.00%, 61.55%, 61.30%` for a cell whose mean is under the goal but some of
    whose seeds reach it (the mean hides them), else ''."""
    seeds = row.get("accuracy_seeds") or []
    solved = sum(accuracy >= GOAL_ACCURACY for accuracy in seeds)
    each = ", ".join(f"{percent(accuracy)}%" for accuracy in seeds)
    return f"solved at {solved} of {len(seeds)} seeds: {each}" if solved and row["accuracy"] < GOAL_ACCURACY else ""


def why_unsolved(row: dict) -> str:
    """Why a cell under the goal may not be the model's best (the issue: BERT solves the task, or the report says
    why not): some of its seeds solve it (a mean under the goal hides them), still improving at the schedule's
    end, or its rate an edge of the grid; else none of these: not learned at this shape and budget."""
    seeds = row.get("accuracy_seeds") or []
    reasons = [solved] if (solved := seeds_solving(row)) else []
    if row.get("still_improving"):
        reasons.append("still improving: a longer schedule may solve it")
    if row.get("rate_edge"):
        reasons.append(f"its rate the grid's {row['rate_edge']}: a rate beyond it may")
    none = "no seed solves it, " if seeds else ""  # a row without its seeds' accuracies says nothing of them
    return "; ".join(reasons) or none + "not rising, its rate inside the grid: not learned at this shape and budget"


def goal_lines(rows: list[dict], pending: dict[str, list[str]] | None = None) -> list[str]:
    """The issue's goals, each met or missed, with where a miss happens; `pending` (K -> the models not measured
    there yet, a report of the map so far) turns a goal that rests on a missing cell into "not yet decided"."""
    pending = pending or {}
    lines = [goal_line(rows, pending, mixer) for mixer in goal_mixers(rows, pending)]
    plain = [r for r in rows if r["architecture"] == "concept" and r["mixer"] == "none"]
    crossed = [f"C={r['concept_num']} K={r['pairs']}{start_suffix(r)}" for r in plain
               if r["accuracy"] > r["no_binding_line"] + 0.02]  # fmt: skip
    later = pending_ks(pending, ", none")
    if plain or later:  # a map without any model of that kind has no such line
        lines.append("- without the mixer, above the no-binding line by more than 2 points: "
                     + (", ".join(crossed) or "none" if plain else f"not measured yet (K={later})")
                     + (f"; K={later} not measured yet" if plain and later else ""))  # fmt: skip
    bert = [r for r in rows if r["architecture"] == "bert"]
    solved = [f"K={r['pairs']}{start_suffix(r)}" for r in bert if r["accuracy"] >= GOAL_ACCURACY]
    unsolved = [f"K={r['pairs']}{start_suffix(r)} {percent(r['accuracy'])}% at lr {r['learning_rate']} ({why_unsolved(r)})"
                for r in bert if r["accuracy"] < GOAL_ACCURACY]  # fmt: skip
    later = pending_ks(pending, "BERT")
    if bert or later:
        lines.append(f"- BERT solves (>= {GOAL_ACCURACY:.0%}): "
                     + (", ".join(solved) or "no K" if bert else f"not measured yet (K={later})")
                     + (f"; not solved: {', '.join(unsolved)}" if unsolved else "")
                     + (f"; K={later} not measured yet" if bert and later else ""))  # fmt: skip
    return lines + capacity_lines(rows, pending)


def goal_mixers(rows: list[dict], pending: dict[str, list[str]]) -> list[str]:
    """The mixers the goal is read for: `conv` (once, before the first layer), and each other variant of it the map
    has at the goal's width, measured or pending: `conv every` (before every layer), `conv from K=4` (a
    curriculum's)."""
    prefix = f"C={GOAL_CONCEPTS}, "
    names = [row_name(r) for r in rows] + [name for names in pending.values() for name in names]
    variants = {name.removeprefix(prefix) for name in names if name.startswith(prefix + "conv")}
    return ["conv", *sorted(variants - {"conv"})]


def goal_line(rows: list[dict], pending: dict[str, list[str]], mixer: str) -> str:
    """The recall goal for `mixer` (`conv` or `conv every`) at `GOAL_CONCEPTS`: met, missed (at which K) or not
    yet decided (a K up to the goal's not measured)."""
    met, measured = holds(rows, GOAL_CONCEPTS, mixer, GOAL_PAIRS)
    missing = sorted(int(k) for k, models in pending.items()
                     if f"C={GOAL_CONCEPTS}, {mixer}" in models and int(k) <= GOAL_PAIRS)  # fmt: skip
    misses = [f"K={r['pairs']} {percent(r['accuracy'])}%" + (f" ({solved})" if (solved := seeds_solving(r)) else "")
              for r in rows if r["architecture"] == "concept"
              and r["concept_num"] == GOAL_CONCEPTS and mixer_name(r) == mixer and r["pairs"] <= GOAL_PAIRS
              and r["accuracy"] < GOAL_ACCURACY]  # fmt: skip
    if not measured:
        verdict = "not measured"
    elif not met:
        verdict = f"missed ({', '.join(misses)})"
    elif missing or GOAL_PAIRS not in measured:  # held wherever measured, but a K up to the goal's not yet run
        missing = sorted(set(missing) | ({GOAL_PAIRS} - set(measured)))
        verdict = (f"not yet decided (held at K={', '.join(map(str, measured))}; K={', '.join(map(str, missing))} "
                   "not measured)")  # fmt: skip
    else:  # every K measured up to the goal's held; which they are, since a map may plan only some
        verdict = f"met (held at K={', '.join(map(str, measured))})"
    where = " before every layer" if mixer.startswith("conv every") else ""
    where += f", each seed from its own{mixer.partition(' from')[2]} model," if " from " in mixer else ""
    return f"- the mixer{where} at C={GOAL_CONCEPTS} holds >= {GOAL_ACCURACY:.0%} up to K={GOAL_PAIRS}: {verdict}"


def mixer_name(row: dict) -> str:
    """`none`, `conv` (once, before the first layer) or `conv every` (before every layer) of a row or cell (rows
    written before the placement axis have no placement: `first`), then where its models start (`conv from K=4`:
    a curriculum's; rows written before it start from scratch)."""
    every = row["mixer"] != "none" and row.get("placement", "first") == "every"
    return (f"{row['mixer']} every" if every else row["mixer"]) + start_suffix(row)


def start_suffix(row: dict) -> str:
    """` from K=4` for a row or cell of a curriculum starting at K = 4, else ''."""
    return f" from K={row['start']}" if row.get("start") else ""


def row_name(row: dict) -> str:
    if row["architecture"] == "bert":
        return "BERT" + start_suffix(row)
    return f"C={row['concept_num']}, {mixer_name(row)}"


def format_markdown(report: dict) -> str:
    rows = report["rows"]
    pairs = sorted(int(k) for k in report["lines"])  # every K planned, measured or not
    names = list(dict.fromkeys(row_name(m) for m in report.get("models", rows)))  # every model planned, in order
    by = {(row_name(r), r["pairs"]): r for r in rows}

    def cell_text(row: dict | None) -> str:
        if row is None:
            return "-"
        seeds = len(row["seeds"])
        return f"{percent(row['accuracy'], row['accuracy_std'] if seeds > 1 else None)}" + ("" if seeds > 1 else " ¹")

    lines = [f"# Associative recall: the capacity map ({report['name']})", "", report["settings_line"], "",
             "Test accuracy (%) at the step chosen on dev, mean ± std over seeds; ¹ one seed (the cells outside "
             "the main ones, or a map run with --seeds 1). Chance is " + percent(report["chance"]) + "%.", "",
             "| model | " + " | ".join(f"K={k}" for k in pairs) + " |", "|---|" + "---|" * len(pairs),
             *(f"| {n} | " + " | ".join(cell_text(by.get((n, k))) for k in pairs) + " |" for n in names),
             "| no-binding line | " + " | ".join(percent(report["lines"][str(k)]) for k in pairs) + " |",
             "| TF-IDF (word 1-2 grams) + linear | "
             + " | ".join(percent(report.get("tfidf", {}).get(str(k))) for k in pairs) + " |", "",
             "## Each cell", "",
             "| K | keys | model | seeds | test acc. (dev-chosen) | test acc. (last step) | rate | best-dev steps | "
             "runs | cell wall-clock (s) |", "|" + "---|" * 10]  # fmt: skip
    for r in rows:
        rate = f"{r['learning_rate']}" + (f" (grid's {r['rate_edge']})" if r.get("rate_edge") else "")
        lines.append(f"| {r['pairs']} | {r['keys']} | {r['label']} | {len(r['seeds'])} | "
                     f"{percent(r['accuracy'], r['accuracy_std'] if len(r['seeds']) > 1 else None)} | "
                     f"{percent(r['accuracy_last'])} | "
                     f"{rate} | {', '.join(map(str, r['best_steps']))} | {r['runs']} | "
                     f"{r['cell_seconds']:.0f} |")  # fmt: skip
    total = sum(r["cell_seconds"] for r in rows)
    lines += ["", f"The map's wall-clock: {total / 60:.0f} min, the sum of its {len(rows)} cells' own times (cells "
              "measured at once, `--jobs`, overlap: the map took less)."]  # fmt: skip
    if missing := report.get("not_measured"):  # a report of the map so far (`--report_only`)
        measured = {str(k): sum(1 for r in rows if r["pairs"] == k) for k in pairs}
        text = "; ".join(f"K={k}: " + ("every cell" if not measured[k] else ", ".join(models))
                         for k, models in missing.items())  # fmt: skip
        lines += ["", f"**The map so far: {len(rows)} of {report['cells']} cells.** Not measured yet: {text}. The "
                  "goals below read the finished cells only."]  # fmt: skip
    lines += ["", "## Goals", "", *report["goals"]]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """A heat map per mixer (and BERT's row), accuracy over C and K with the numbers written in; beside them,
    accuracy against K per model with the no-binding line and chance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    models = report.get("models", rows)  # every model planned: one not measured yet is an empty row
    pairs = sorted(int(k) for k in report["lines"])  # every K planned: a K not measured yet is an empty column
    variants = [*LOCAL_MIXERS, *(f"{m} every" for m in LOCAL_MIXERS if m != "none")]  # mixer, placement
    planned = {mixer_name(m) for m in models if m["architecture"] == "concept"}  # a curriculum's: `conv from K=4`
    panels = sorted(planned, key=lambda v: (" from " in v, variants.index(v.split(" from ")[0])))
    figure, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 4.5), squeeze=False)
    for axis, mixer in zip(axes[0], panels, strict=False):
        start = mixer[mixer.index(" from ") :] if " from " in mixer else ""  # BERT's row: the same start's
        bert = [r for r in rows if r["architecture"] == "bert" and start_suffix(r) == start]
        bert_planned = any(m["architecture"] == "bert" and start_suffix(m) == start for m in models)
        widths = sorted({m["concept_num"] for m in models if m["architecture"] == "concept"
                         and mixer_name(m) == mixer})  # fmt: skip
        found = {(r["concept_num"], r["pairs"]): r["accuracy"] for r in rows if mixer_name(r) == mixer
                 and r["architecture"] == "concept"}  # fmt: skip
        labels = [f"C={c}" for c in widths] + (["BERT"] if bert_planned else [])
        grid = [[found.get((c, k), float("nan")) for k in pairs] for c in widths]
        grid += [[next((100 * r["accuracy"] for r in bert if r["pairs"] == k), float("nan")) / 100 for k in pairs]] if bert_planned else []  # fmt: skip
        image = axis.imshow([[100 * v for v in line] for line in grid], vmin=0, vmax=100, cmap="viridis",
                            aspect="auto")  # fmt: skip
        for i, line in enumerate(grid):
            for j, value in enumerate(line):
                if value == value:  # not NaN
                    axis.text(j, i, f"{100 * value:.0f}", ha="center", va="center", fontsize=8,
                              color="white" if value < 0.6 else "black")  # fmt: skip
        axis.set_xticks(range(len(pairs)), [str(k) for k in pairs])
        axis.set_yticks(range(len(labels)), labels)
        axis.set_xlabel("pairs K")
        axis.set_title(f"mixer: {mixer}")
        figure.colorbar(image, ax=axis, label="test accuracy (%)")
    curves = axes[0][-1]
    for name in dict.fromkeys(row_name(r) for r in rows):
        points = sorted((r["pairs"], 100 * r["accuracy"]) for r in rows if row_name(r) == name)
        curves.plot(*zip(*points, strict=True), marker="o", label=name)
    line = [100 * report["lines"][str(k)] for k in pairs]  # drawn with a marker too: one K still shows its line
    curves.plot(pairs, line, "k--", linewidth=1, marker="_", markersize=14, label="no-binding line")
    if tfidf := sorted((int(k), 100 * a) for k, a in report.get("tfidf", {}).items()):
        curves.plot(*zip(*tfidf, strict=True), color="grey", linestyle="-.", linewidth=1, marker="x", label="TF-IDF")
    curves.axhline(100 * report["chance"], color="grey", linestyle=":", linewidth=1, label="chance")
    curves.set_xscale("log", base=2)
    curves.set_xticks(pairs, [str(k) for k in pairs])
    curves.set_xlabel("pairs K")
    curves.set_ylabel("test accuracy (%)")
    curves.set_ylim(0, 102)
    curves.legend(fontsize=7)
    so_far = f", {len(rows)} of {report['cells']} cells so far" if report.get("not_measured") else ""
    figure.suptitle(f"Associative recall: capacity map ({report['name']}{so_far})")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m concept_encoder recall",
        description="Associative recall's capacity map: test accuracy against K for the Concept Encoder at several "
                    "widths, without and with the local mixer, beside BERT of the same shape and the no-binding line.",
    )  # fmt: skip
    parser.add_argument("--pairs", default="4,8,16,32,64,128", help="the Ks (key-value pairs an example)")
    parser.add_argument("--concepts", default="16,32,64,128", help="the Concept Encoder's widths C")
    parser.add_argument("--mixers", default="none,conv", help=f"local mixers, from {LOCAL_MIXERS}")
    parser.add_argument("--placements", default="first",
                        help=f"where the conv mixer acts, from {LOCAL_MIXER_PLACEMENTS}: once before the first layer "
                             "(first) and/or before every layer (every, cells C<C>-conv-every)")  # fmt: skip
    parser.add_argument("--architectures", default="concept,bert", help="concept and/or bert")
    parser.add_argument("--starts", default="scratch",
                        help="where each cell's models start: scratch, and/or a K0 of --pairs (a curriculum: every "
                             "cell at K > K0 also measured from its K0 cell's model of each seed, cells <cell>-from<K0>; "
                             "the K0 cells from scratch always run)")  # fmt: skip
    parser.add_argument("--preset", default="micro", help="the model shape (one preset)")
    parser.add_argument(
        "--main_concepts",
        default=None,
        help=f"widths of the main cells (--seeds seeds), from --concepts (default: those of {MAIN_CONCEPTS})",
    )
    parser.add_argument(
        "--main_pairs",
        default=None,
        help=f"Ks of the main cells (--seeds seeds), from --pairs (default: those of {MAIN_PAIRS})",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the main cells")
    parser.add_argument("--sweep_seeds", type=int, default=1, help="seeds of the other cells")
    parser.add_argument(
        "--keys", type=at_least(1), default=KEYS, help="key symbols (a K above it draws from K symbols)"
    )
    parser.add_argument("--values", type=at_least(2), default=VALUES, help="value symbols (the classes)")
    parser.add_argument(
        "--train", type=at_least(100), default=None, help="training examples (default: the task's 20,000)"
    )
    parser.add_argument("--report_only", action="store_true",
                        help="write the report of the cells finished so far (the others shown as not measured yet) "
                             "and run nothing: a map that takes hours, looked at while it runs")  # fmt: skip
    add_jobs_argument(parser, "cells")
    add_archive_argument(parser, "map", "docs/measured/recall")
    add_report_driver_arguments(parser, "recall", "Cache/recall")
    return parser


def main_values(text: str | None, flag: str, default: str, planned: list[int], planned_flag: str) -> list[int]:
    """The main cells' Ks or widths: those given, each one the map plans (a typo would quietly make every cell a
    one-seed sweep cell), else the defaults the map plans."""
    if text is None:
        return [v for v in parse_list(default, flag, int) if v in planned]
    values = parse_list(text, flag, int)
    if stray := [v for v in values if v not in planned]:
        raise ValueError(f"{flag}: {stray} not in {planned_flag} {','.join(map(str, planned))}; main cells are cells "
                         f"of the map: choose from {planned_flag}")  # fmt: skip
    return values


def check_arguments(args) -> None:
    """Every argument checked before anything runs (ValueError naming it)."""
    args.pair_list = sorted(parse_list(args.pairs, "--pairs", int))  # the map runs K ascending
    args.concept_list = parse_list(args.concepts, "--concepts", int)
    args.main_pair_list = main_values(args.main_pairs, "--main_pairs", MAIN_PAIRS, args.pair_list, "--pairs")
    args.main_concept_list = main_values(args.main_concepts, "--main_concepts", MAIN_CONCEPTS, args.concept_list,
                                         "--concepts")  # fmt: skip
    if any(v < 1 for v in [*args.pair_list, *args.concept_list]):
        raise ValueError("--pairs and --concepts are whole numbers >= 1")
    args.mixer_list = parse_choices(args.mixers, "--mixers", LOCAL_MIXERS)
    args.placement_list = parse_choices(args.placements, "--placements", LOCAL_MIXER_PLACEMENTS)
    if args.placement_list != ["first"] and args.mixer_list == ["none"]:
        raise ValueError(f"--placements {args.placements}: places the conv mixer, but --mixers is none; add conv to "
                         "--mixers or leave --placements out")  # fmt: skip
    args.architecture_list = parse_choices(args.architectures, "--architectures", ARCHITECTURES)
    if args.preset not in PRESETS:
        raise ValueError(f"--preset {args.preset!r} unknown; choose from {sorted(PRESETS)}")
    if args.seeds < 1 or args.sweep_seeds < 1:
        raise ValueError("--seeds and --sweep_seeds must be >= 1")
    check_jobs(args)
    check_starts(args)
    for pairs in args.pair_list:  # every task's settings, before the first run (parse_recall names the fix)
        parse_recall(task_name(pairs, args))


def check_starts(args) -> None:
    """`--starts` parsed (`args.start_list`, `args.curriculum`: the K0 or None) and checked: one K0, a K of --pairs
    below another, its cells run at least the seeds of the cells starting from them, and its vocabulary theirs."""
    args.start_list = parse_list(args.starts, "--starts")
    ks = [s for s in args.start_list if s != "scratch"]
    if any(not k.isdigit() for k in ks) or len(ks) > 1:
        raise ValueError(f"--starts {args.starts!r}: give scratch and/or one K of --pairs to start a curriculum from, "
                         "e.g. scratch,4")  # fmt: skip
    args.curriculum = int(ks[0]) if ks else None
    if args.curriculum is None:
        return
    start = args.curriculum
    if start not in args.pair_list or start == max(args.pair_list):
        raise ValueError(f"--starts {start}: the curriculum starts from the cells at K={start} and measures the larger "
                         f"K: give --pairs {start} and a larger K (now --pairs {args.pairs})")  # fmt: skip
    if (larger := max(args.keys, max(args.pair_list))) > max(args.keys, start):
        raise ValueError(f"--starts {start}: K={max(args.pair_list)} draws its keys from {larger} symbols, K={start} "
                         f"from {max(args.keys, start)}: the K={start} models' embeddings cannot read them; pass "
                         f"--keys {larger} (every K then draws from {larger} keys)")  # fmt: skip
    if start not in args.main_pair_list and any(k > start for k in args.main_pair_list):
        raise ValueError(f"--starts {start}: the main cells at K={','.join(map(str, args.main_pair_list))} run "
                         f"--seeds {args.seeds} seeds, each from its own K={start} model, but K={start} is not a main "
                         f"K (--sweep_seeds {args.sweep_seeds}); add {start} to --main_pairs")  # fmt: skip


def archive_folder(args, pairs: int) -> Path | None:
    """K's folder in `--archive` (named as in `--runs_dir`), or None without one."""
    return cache_path(args.archive) / f"{args.name}-K{pairs}" if args.archive else None


def measure_map(plan: list[Cell], tasks: dict, root: Path, args, argvs: dict[int, list[str]]) -> dict | None:
    """`(K, cell key) -> point` for every cell of `plan`, finished ones reused, the others measured, `--jobs` at a
    time (in `plan`'s order); None when another process holds a K's folder or a run failed (finished cells stay:
    the same command continues)."""
    locks = []
    for pairs in tasks:  # every K's folder, before any run: one invocation measures a map at a time
        folder = root / f"{args.name}-K{pairs}"
        if (lock := exclusive(folder, f"recall {folder.name}")) is None:
            for held in locks:
                held.release()
            return None
        locks.append(lock)
    with holding(*locks) as outcome:
        # the name in the folder: fine-tuning runs are named after it
        folders = {pairs: PointFolder(root / f"{args.name}-K{pairs}", task, argvs[pairs], args.num_processes,
                                      probe=False, archive=archive_folder(args, pairs))
                   for pairs, task in tasks.items()}  # fmt: skip
        check_start_models(plan, folders)
        # a curriculum cell waits for the point it starts from (earlier in the plan: running, or done, under --jobs)
        started = {(c.start, c.start_cell.key): Future() for c in plan if c.start}
        followers = {(c.start, c.start_cell.key): c for c in plan if c.start and not folders[c.pairs].done(c.key)}
        jobs, pending = [], 0
        for cell in job_order(plan, folders):
            folder = folders[cell.pairs]
            tokenizer = load_tokenizer(f"recall:{cell.keys}:{args.values}")
            model = None if cell.start else model_folder(folder.folder, cell, args.preset, example_tokens(cell.pairs),
                                                         tokenizer)  # fmt: skip
            what = f"[{plan.index(cell) + 1}/{len(plan)}] K={cell.pairs}, {cell.label}"
            jobs.append(functools.partial(measure_cell, folder, cell, model, what, started, followers))
            pending += not folder.done(cell.key)
        points = dict(measure_at_once(jobs, args, "cells", pending))
    return None if outcome.failed else points


def job_order(plan: list[Cell], folders: dict[int, PointFolder]) -> list[Cell]:
    """The order the cells are measured in: the map's, but the curriculum cells whose start's models are not here
    yet (its point still to measure, or restored without them: `remade_start`) last. Jobs are taken in order, so
    under `--jobs` a cell waiting for its start would hold a worker that another cell could use, and with one
    worker a cell before its start would wait for ever."""

    def waits(cell: Cell) -> bool:
        return bool(cell.start) and ((point := start_point(cell, folders)) is None or not models_here(point, cell))

    return sorted(plan, key=waits)


def measure_cell(point_folder: PointFolder, cell: Cell, model: Path | None, what: str,
                 started: dict[tuple, Future], followers: dict[tuple, Cell]) -> tuple[tuple, dict]:  # fmt: skip
    """One cell's point, reused or measured (and copied into `--archive`); `((K, cell key), point)`. A curriculum
    cell (`model` None) still to measure first waits in `started` for the point holding its start's models; a cell
    others start from sets it there: its own, or, restored without its models, `remade_start`'s (`followers`: a
    cell still to measure starting from it, by its `(K, key)`; none: a finished map needs no models)."""
    key = (cell.pairs, cell.key)
    try:
        if cell.start and not point_folder.finished(cell.key, cell_argv(cell)):  # a finished one needs no model
            model = start_models(started[(cell.start, cell.start_cell.key)].result(), cell)
        point = point_folder.reused_or_measured(cell.key, str(model), cell_argv(cell), {"cell": cell.__dict__}, what)
        if key in started and (follower := followers.get(key)) and not models_here(point, follower):
            models = remade_start(point_folder, cell, point, model, follower)
        else:
            models = point
    except BaseException as error:  # the cells waiting for this one fail with it, not wait for ever
        if key in started:
            started[key].set_exception(error)
        raise
    if key in started:
        started[key].set_result(models)
    return key, point


class StartModelsGone(ValueError):
    """A curriculum's start point is here but its models are not (a point restored from `--archive` keeps results,
    not models): `remade_start` makes them again."""


def start_models(point: dict, cell: Cell) -> str:
    """The models a curriculum cell fine-tunes, one per seed, as a `{seed}` path (`loops/finetune.py` reads each
    seed's own): the `final` folders of its start cell's runs at the rate chosen there. ValueError naming the
    seeds the start lacks; `StartModelsGone` for a folder that is not on this machine."""
    _, runs = chosen_runs(point)
    folders = {run["seed"]: Path(run["run_dir"]) / "final" for run in runs}
    first = min(folders)
    head, _, tail = str(folders[first]).rpartition(f"seed{first}")  # `<run>-seed42/final`
    template = f"{head}seed{PER_SEED}{tail}"
    seeds = range(first, first + cell.seeds)
    where = f"K={cell.start}'s cell {point['key']}"
    if missing := [seed for seed in seeds if seed not in folders]:
        raise ValueError(f"{cell.key} at K={cell.pairs}: {where} has no run for seed(s) {missing}, which this cell's "
                         f"seeds start from; measure {where} with as many seeds (--main_pairs)")  # fmt: skip
    for seed in seeds:
        if str(folders[seed]) != template.replace(PER_SEED, str(seed)):
            raise ValueError(f"{where}: its runs' folders are not named one per seed ({folders[seed]})")
        if problem := model_folder_problem(folders[seed]):
            raise StartModelsGone(f"{cell.key} at K={cell.pairs} starts from {where}'s model of seed {seed}, which "
                                  f"is not here: {problem}")  # fmt: skip
    return template


def start_point(cell: Cell, folders: dict[int, PointFolder]) -> dict | None:
    """The point of the cell a curriculum cell starts from, when it is finished (None: still to measure)."""
    start = cell.start_cell
    return folders[start.pairs].finished(start.key, cell_argv(start))


def models_here(point: dict, cell: Cell) -> bool:
    """Whether the models `cell` (a curriculum cell) starts from are on this machine (`start_models`; its other
    problems raised)."""
    try:
        start_models(point, cell)
    except StartModelsGone:
        return False
    return True


def check_start_models(plan: list[Cell], folders: dict[int, PointFolder]) -> None:
    """Every curriculum cell still to measure whose start is measured: its start's models are usable
    (`start_models`), before any run; a start whose models are not here is named once, with what will make them
    (`remade_start`)."""
    named = set()
    for cell in plan:
        if cell.start and not folders[cell.pairs].done(cell.key):
            start, point = cell.start_cell, start_point(cell, folders)
            if point and not models_here(point, cell) and start.key not in named:
                named.add(start.key)
                row, runs = chosen_runs(point)
                print(f"K={start.pairs}'s cell {start.key}: its models are not on this machine (a point restored "
                      f"from --archive keeps results, not models): its {len(runs)} run(s) at the rate chosen there "
                      f"({row['learning_rate']:g}) run again first, as point {start.key}{REMADE}, and must "
                      "reproduce its test accuracy and best-dev step at every seed", flush=True)  # fmt: skip


REMADE = "-models"  # the point of a start's runs made again on this machine (`remade_start`)


class StartNotReproduced(RuntimeError):
    """A start made again (`remade_start`) whose runs do not reproduce its restored point: the driver stops with one
    line (a RuntimeError), the cells after it not started."""


def recorded_threads(runs: list[dict]) -> int | None:
    """The CPU threads a point's runs recorded (`cpu_threads`, the same count for every run), else None: runs
    finished before they recorded it, or under different counts (a run resumed under another count records a list
    of them)."""
    counts = {str(run.get("cpu_threads")) for run in runs}
    first = runs[0].get("cpu_threads") if runs else None
    return first if len(counts) == 1 and isinstance(first, int) else None


def not_reproduced_why(runs: list[dict], recorded: int | None) -> tuple[str, str]:
    """Why a start made again may not reproduce its runs, from the thread counts they recorded, and what to try
    first ("" where a rerun under another count cannot help)."""
    counts = [run["cpu_threads"] for run in runs if run.get("cpu_threads") is not None]
    if recorded:
        return f"Its runs recorded {recorded} thread(s), as here: another CPU or library version differs", ""
    if counts:  # a run resumed under another count, or runs under different ones
        return (f"Its runs ran under different thread counts ({', '.join(map(str, counts))}), which no one count "
                "reproduces", "")  # fmt: skip
    return (
        "Its runs recorded no thread count, and on the CPU a result depends on it",
        "rerun with CPU_THREADS=<the count they ran with> (the runs of each count are kept apart), or ",
    )


def remade_start(folder: PointFolder, start: Cell, point: dict, model: Path, follower: Cell) -> dict:
    """The start cell's models made again where its point was restored without them: its runs at the rate chosen
    there, every seed, as point `<start>-models` of its K's folder (reused while its models are here). Seeded runs
    reproduce on the CPU under the same thread count (a sum over other threads rounds differently, and a model that
    binds suddenly can amplify the last bit into another result: docs/recall.md), so the runs are made with the
    threads the point's runs recorded (where they recorded none, this machine's, and the runs are named for it), and
    each seed's test accuracy and best-dev step must equal the restored point's. Else `StartNotReproduced` naming
    both; the point made here is set aside (`PointFolder.set_aside`, not archived) and the curriculum cells do not
    start from models its row does not describe. The point is archived once it reproduces."""
    from ..training.runtime import launch_threads  # torch loads only where a start is made again

    key, (row, runs) = start.key + REMADE, chosen_runs(point)
    extra = [*cell_argv(start), "--learning_rates", f"{row['learning_rate']:g}"]
    recorded = recorded_threads(runs)
    threads = recorded or launch_threads(folder.processes)
    again = folder.finished(key, extra)
    if again is None or not models_here(again, follower):
        whose = "as its runs recorded" if recorded else "its runs recorded none: this machine's"
        print(f"{key}: K={start.pairs}, {start.label}: its models made again here (the rate chosen there alone, "
              f"{threads} CPU thread(s) a rank, {whose})", flush=True)  # fmt: skip
        again = folder.measure(key, str(model), extra, {"cell": start.__dict__, "remakes": start.key},
                               threads=threads, keep=False)  # fmt: skip
    now, _ = chosen_runs(again)
    if (row["accuracy_seeds"], row["best_steps"]) != (now["accuracy_seeds"], now["best_steps"]):
        aside = folder.set_aside(key)
        why, retry = not_reproduced_why(runs, recorded)
        raise StartNotReproduced(
            f"K={start.pairs}'s cell {start.key} made again here does not reproduce its restored point (test accuracy "
            f"per seed {row['accuracy_seeds']}, best-dev steps {row['best_steps']}; here, with {threads} CPU "
            f"thread(s) a rank, {now['accuracy_seeds']}, {now['best_steps']}; set aside as {aside}). {why}. Its "
            f"curriculum cannot start from models its row does not describe: {retry}measure the curriculum under a "
            "new --name"
        )
    folder.keep(key)
    return again


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, loop_argv, finetune_argv = parse_driver_argv(parser, argv)
    root = cache_path(args.runs_dir)
    with usage_errors(parser):  # every check before the first run starts
        check_arguments(args)
        if loop_argv:
            raise ValueError(f"{loop_argv} after --: the recall driver pretrains nothing; pass fine-tuning "
                             "arguments in --finetune_args")  # fmt: skip
        refuse_driver_flags(finetune_argv, DRIVER_FINETUNE_FLAGS, "--finetune_args:", "by the recall driver")
        finetune_argv = given_or_default(finetune_argv, FINETUNE_DEFAULTS)
        plan = cells(args)
        tasks = {pairs: task_name(pairs, args) for pairs in args.pair_list}
        argvs = {pairs: sized_argv(finetune_argv, pairs) for pairs in args.pair_list}
        # what every cell of a K shares; which cells and how many seeds each point checks itself, so a map grows by
        # widths, mixers or seeds under its name (`PointFolder.reused_or_measured`)
        requests = {pairs: {"task": task, "preset": args.preset, "finetune_args": argvs[pairs],
                            "num_processes": args.num_processes} for pairs, task in tasks.items()}  # fmt: skip
        for pairs, task in tasks.items():  # every K checked before any K's request is recorded
            check_finetune_argv(argvs[pairs], task, (), "recall")  # generates the task's splits into the cache
            check_reuse(root / f"{args.name}-K{pairs}", requests[pairs], [], ("cells",), record=False, **MAP_FOLDER)
            if archive := archive_folder(args, pairs):  # its points become this map's: the same request only
                check_archive(archive, requests[pairs], ("cells",), noun="archived map")
        check_report_dir(args.report_dir)
        for pairs in [] if args.report_only else tasks:  # the same checks again, the folder's writability too
            check_reuse(root / f"{args.name}-K{pairs}", requests[pairs], [], ("cells",), **MAP_FOLDER)
    if args.archive:
        restore_archive(root, args, argvs)
    if args.report_only:
        points = finished_points(plan, root, args, argvs)
        if not points:
            print(f"error: no cell of map {args.name!r} ({root}) is finished yet: nothing to report; run the map "
                  "without --report_only", file=sys.stderr)  # fmt: skip
            return 1
    elif (points := measure_map(plan, tasks, root, args, argvs)) is None:
        return 1
    lines = {str(k): no_binding_line(recall_splits(task))["test"] for k, task in tasks.items()}
    tfidf = {}  # K -> TF-IDF + linear's test accuracy: every point of a K holds the same fit (the task's baseline)
    for (pairs, _), point in points.items():
        tfidf.setdefault(str(pairs), point["baselines"][tasks[pairs]]["tfidf"]["validation"]["accuracy"])
    rows = [cell_row(points[(c.pairs, c.key)], c, lines[str(c.pairs)]) for c in plan if (c.pairs, c.key) in points]
    missing = {}  # K -> the models not finished there
    for c in plan:
        if (c.pairs, c.key) not in points:
            missing.setdefault(str(c.pairs), []).append(row_name(c.__dict__))
    report = {"name": args.name, "rows": rows, "lines": lines, "tfidf": tfidf, "chance": 1 / args.values, "tasks": {str(k): t for k, t in tasks.items()},
              "goals": goal_lines(rows, missing), "cells": len(plan), "not_measured": missing,
              "models": [{"architecture": c.architecture, "concept_num": c.concept_num, "mixer": c.mixer,
                          "placement": c.placement, "start": c.start}
                         for c in {row_name(c.__dict__): c for c in plan}.values()],
              "settings_line": f"Preset {args.preset}, fine-tuned from scratch"
                               + (f" (rows `from K={args.curriculum}`: each seed from its K={args.curriculum} cell's "
                                  "model)" if args.curriculum else "") + ", mean pooling: "
                               f"{' '.join(finetune_argv)}; tasks {', '.join(tasks.values())} (2K+4 tokens an "
                               f"example, never cut: --max_seq_length past {DEFAULT_MAX_SEQ_LENGTH} where longer); "
                               f"{args.values} values, keys max({args.keys}, K); "
                               "the test split read once per seed at the step chosen on dev."}  # fmt: skip
    print_report(write_report_files(report, args.report_dir, "recall", format_markdown, plot))
    return 0


__all__ = ["Cell", "cells", "goal_lines", "main"]

if __name__ == "__main__":
    from ..common.entry import run_tool

    sys.exit(run_tool(main, "python -m concept_encoder recall"))
