"""One-axis ablations: run the pretraining loop once per value of one setting, then compare and decide.

    python -m concept_encoder ablate --vary concept_loss_weight=0,0.1,1.0 --decide eval_loss -- \\
        --preset small --max_steps 300 --gate "health/effective_rank_fraction>=0.25@200"
    make ablate VARY=concept_loss_weight=0,0.1,1.0 DECIDE=eval_loss ARGS="--max_steps 300"
    python -m concept_encoder ablate --vary concept_loss_warmup_steps=0,150,300 --heldout licenses \
        --decide heldout/licenses/accuracy_over_unigram -- --preset small --max_steps 300

Each value runs sequentially as its own run (`<name>-<setting><value>` under the loop's
`--output_dir`), with the same seed and every other argument fixed. A run stopped by a gate (its
`summary.json` says so: `accelerate launch` reports the loop's exit code 3 as 1) is kept in the
comparison as rejected; rerunning the same command skips the values
whose runs finished, and resumes an interrupted one from its checkpoint. The comparison
(`concept_encoder.decide.compare`) follows, and the winner is named by the deciding metric (lower is better
for losses, perplexity and cosines, higher otherwise; `--direction` overrides) among the runs no
gate rejected. Varying two settings at once is refused: one thing at a time.

`--heldout TEXT` adds the held-out language check (`check_health MODEL --text TEXT`: masked-token accuracy on
text none of the runs trained on, beside that text's unigram baseline) of each run's final model, saved as
`<run>/heldout-<name>.json` (rerun only when the text changed) and compared as `heldout/<name>/<metric>`,
e.g. `heldout/licenses/accuracy_over_unigram`, which `--decide` can name.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
from pathlib import Path

from ..common import process_group
from ..common.cli_types import at_least
from ..common.differences import differences
from ..common.entry import INTERRUPTED, TERMINATED, Terminated
from ..common.faults import DiskFullError
from ..common.paths import PROJECT_ROOT
from ..common.report_files import check_report_dir
from ..constants import LICENSES_DATASET, pretraining_metric_names
from ..training.args import parse_args
from ..training.plan import launch_command, local_launcher
from ..training.runs import ended_on_its_own, unfinished_launch
from .compare import compare, lower_is_better


def parse_vary(texts: list[str]) -> tuple[str, list[str]]:
    """`["name=v1,v2"]` → ("name", ["v1", "v2"]); values that hold commas themselves (a `--dataset` mixture) are
    separated by `|` instead: `["dataset=docstrings|docstrings,task:embedded*8"]`. ValueError for two axes, a
    missing `=`, or < 2 values."""
    if len(texts) != 1:
        axes = ", ".join(text.split("=")[0] for text in texts)
        raise ValueError(
            f"--vary was given {len(texts)} times ({axes}): an ablation varies one thing at a time; "
            "run one ablation per setting (a grid confounds the axes)"
        )
    name, sep, values = texts[0].partition("=")
    options = [v.strip() for v in values.split("|" if "|" in values else ",") if v.strip()]
    if not sep or not name.strip():
        raise ValueError(f"--vary {texts[0]!r}: write name=value1,value2,...")
    if len(options) < 2:
        raise ValueError(f"--vary {texts[0]!r}: give at least two values to compare")
    return name.strip().lstrip("-"), options


def safe_name(text: str) -> str:
    """`text` as one folder or file name part: every character but letters, digits and `._-` becomes `_`, and a
    name so folded ends in a digest of `text`, so distinct texts never share a name (`a,b` and `a;b`)."""
    folded = "".join(c if c.isalnum() or c in "._-" else "_" for c in text)
    return folded if folded == text else f"{folded}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def run_name_for(base: str, setting: str, value: str) -> str:
    return f"{base}-{setting}{safe_name(value)}"


def run_loop(command: list[str]) -> int:
    """Run one value's `accelerate launch ... loops/mlm.py ...` command; its exit code (Ctrl-C: the ranks stop at
    a checkpoint, `process_group.call_interrupting_ranks`)."""
    return process_group.call_interrupting_ranks(command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m concept_encoder ablate",
        description="Run loops/mlm.py once per value of ONE setting, compare the runs, name the winner.",
        epilog="Everything after `--` is passed to loops/mlm.py unchanged (except the varied setting and --run_name).",
    )
    parser.add_argument("--vary", action="append", required=True,
                        help="setting=value1,value2,... (exactly once); values separated by | where they hold commas, "
                        "e.g. 'dataset=docstrings|docstrings,task:embedded*8'")  # fmt: skip
    parser.add_argument("--decide", required=True, help="the deciding metric of summary.json, e.g. eval_loss")
    parser.add_argument("--direction", choices=("lower", "higher"), help="which is better (default: by the name)")
    parser.add_argument("--name", default="ablate", help="prefix of the run names (default: ablate)")
    parser.add_argument("--num_processes", type=at_least(1), default=1, help="processes per run (accelerate launch)")
    parser.add_argument(
        "--heldout",
        help="held-out language check of each run's final model on this text: `licenses` (the installed packages' "
        "license texts) or a .txt/.jsonl/.parquet file; compared as heldout/<name>/<metric>",
    )
    return parser


# Arguments that name, place or display a run: varying them changes nothing the loop learns.
NOT_EXPERIMENTAL = ("run_name", "output_dir", "resume_from_checkpoint", "progress_bar", "report_to", "wandb_project",
                    "logging_steps", "save_steps", "save_total_limit", "snapshot_steps", "peak_tflops",
                    "save_dtype", "allow_cpu")  # fmt: skip


def experiment_settings(parsed) -> dict:
    """The resolved settings of parsed loop arguments that define the experiment (`NOT_EXPERIMENTAL` left out),
    as `group.name: value` with JSON types, comparable with a finished run's config.json."""
    groups = ("model_args", "data_args", "training_args")
    flat = {f"{g}.{k}": v for g, part in zip(groups, parsed, strict=True) for k, v in dataclasses.asdict(part).items()}
    flat = {k: v for k, v in flat.items() if k.split(".", 1)[1] not in NOT_EXPERIMENTAL}
    return json.loads(json.dumps(flat, default=str))


def plan_runs(setting: str, values: list[str], loop_argv: list[str], name: str) -> list[tuple[str, list[str], dict]]:
    """(run name, loop argv, experiment settings) per value, each checked by the loop's own parser before anything
    runs; an axis that changes no experiment setting is refused."""
    plans = []
    for value in values:
        run_name = run_name_for(name, setting, value)
        argv = [*loop_argv, f"--{setting}", value, "--run_name", run_name]
        try:
            parsed = parse_args(argv)
        except ValueError as error:
            raise ValueError(f"--vary {setting}={value}: {error}") from error
        command = ["--resume_from_checkpoint", "auto", *launch_command([], *parsed, launcher=())[1:]]
        plans.append((run_name, command, experiment_settings(parsed)))
    if all(plan[2] == plans[0][2] for plan in plans[1:]):
        raise ValueError(
            f"--vary {setting}: its values change no setting of the experiment (they name, place or display the "
            "runs, or resolve to the same value); vary something the loop learns from"
        )
    return plans


def changed_settings(run_dir: Path, settings: dict) -> list[str]:
    """Where a finished run's config.json differs from the settings this invocation would run it with."""
    config = json.loads((run_dir / "config.json").read_text())
    saved = {f"{g}.{k}": v for g in ("model_args", "data_args", "training_args") for k, v in config.get(g, {}).items()}
    return differences(saved, settings, "the run has", "this invocation", keys=[k for k in settings if k in saved])


def choose_winner(result: dict, runs: list[tuple[str, Path]], metric: str, direction: str, rejected: set[str]):
    """(run name, value) of the best run by `metric` among those no gate rejected and with a finite value (NaN or
    infinity never wins); None if none qualifies."""
    values = result["metrics"].get(metric)
    if values is None:
        raise ValueError(
            f"--decide {metric}: not in every run's summary.json; choose one of {', '.join(result['metrics'])}"
        )
    candidates = [(v, name) for (name, _), v in zip(runs, values, strict=True)
                  if name not in rejected and isinstance(v, int | float) and math.isfinite(v)]  # fmt: skip
    if not candidates:
        return None
    best = min(candidates) if direction == "lower" else max(candidates)
    return best[1], best[0]


HELDOUT_METRICS = ("accuracy_over_unigram", "masked_token_accuracy", "masked_token_loss", "unigram_baseline_accuracy")


def heldout_name(spec: str) -> str:
    """The short name of a held-out text: `licenses`, or a file's stem (`novel.txt` → `novel`)."""
    return safe_name(spec if spec == LICENSES_DATASET else Path(spec).stem)


def heldout_metric_names(spec: str) -> tuple[str, ...]:
    return tuple(f"heldout/{heldout_name(spec)}/{metric}" for metric in HELDOUT_METRICS)


def heldout_problem(spec: str) -> str | None:
    """Why `spec` cannot be the held-out text (checked before any run); None when it can."""
    if spec == LICENSES_DATASET or Path(spec).expanduser().is_file():
        return None
    return f"--heldout {spec!r}: no such file; give a .txt/.jsonl/.parquet file or `licenses`"


def heldout_check(run_dir: Path, spec: str) -> int:
    """`check_health <run>/final --text spec --json <run>/heldout-<name>.json`, unless that file already holds
    the check of this very text (same fingerprint); the check's exit code."""
    from . import check_health  # deferred: datasets and torch load only when a check runs

    out = run_dir / f"heldout-{heldout_name(spec)}.json"
    if out.is_file() and json.loads(out.read_text()).get("fingerprint") == check_health.heldout_fingerprint(spec):
        return 0
    return check_health.main([str(run_dir / "final"), "--text", spec, "--json", str(out)])


REPORT_DIR = "Cache/reports"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, loop_argv = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = build_parser()
    args = parser.parse_args(own)
    try:
        setting, values = parse_vary(args.vary)
        plans = plan_runs(setting, values, loop_argv, args.name)
        model_args, _, train_args = parse_args(loop_argv)
        decidable = pretraining_metric_names(train_args.objective, model_args.architecture)
        if args.heldout:
            if problem := heldout_problem(args.heldout):
                raise ValueError(problem)
            decidable += heldout_metric_names(args.heldout)
        if args.decide not in decidable:  # checked before any run starts
            raise ValueError(
                f"--decide {args.decide}: the loop evaluates no such metric; choose one of {', '.join(decidable)}"
            )
        check_report_dir(REPORT_DIR, "the comparison's report folder")  # written after every run: checked first
    except ValueError as error:
        parser.exit(2, f"usage error: {error}\n")
    output_dir = Path(train_args.output_dir)
    direction = args.direction or ("lower" if lower_is_better(args.decide) else "higher")
    launcher = local_launcher(PROJECT_ROOT / "loops" / "mlm.py", args.num_processes)
    stale = {name: changed for name, _, settings in plans
             if (output_dir / name / "config.json").is_file() and (changed := changed_settings(output_dir / name, settings))}  # fmt: skip
    if stale:  # a finished (or started) value is reused only under the settings this invocation asks for
        name, changed = next(iter(stale.items()))
        parser.exit(2, f"usage error: {output_dir / name} was run with other settings ({'; '.join(changed[:5])}); "
                       "choose another --name for this ablation, or delete that run\n")  # fmt: skip
    rejected, runs = set(), []
    try:
        for index, (run_name, run_argv, _) in enumerate(plans, start=1):
            run_dir = output_dir / run_name
            runs.append((run_name, run_dir))
            if ended_on_its_own(run_dir):
                print(f"[{index}/{len(plans)}] {run_name}: finished earlier, skipped", flush=True)
            else:
                print(f"[{index}/{len(plans)}] {run_name}: {setting}={values[index - 1]}", flush=True)
                started = time.time()
                code = run_loop([*launcher, *run_argv])
                if why := unfinished_launch(run_dir, code, started):  # a gate's stop is an end: the value is compared
                    print(f"{run_name} {why}; rerun the same command (once fixed, if it failed): it resumes from "
                          "its newest checkpoint", file=sys.stderr)  # fmt: skip
                    return code or 1
            if args.heldout:
                code = heldout_check(run_dir, args.heldout)
                if code != 0:
                    print(f"{run_name}: the held-out check on {args.heldout} failed (exit code {code}); rerun the same "
                          "command once it is fixed (finished runs are reused)", file=sys.stderr)  # fmt: skip
                    return code
            summary = json.loads((run_dir / "summary.json").read_text())
            if any(g["passed"] is False for g in summary.get("gates", [])):
                rejected.add(run_name)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (`Terminated`): the running value checkpointed
        print("\ninterrupted: rerun the same command to continue (finished values are reused, the interrupted one "
              "resumes from its newest checkpoint)", file=sys.stderr)  # fmt: skip
        return TERMINATED if isinstance(stop, Terminated) else INTERRUPTED
    try:
        result = compare([d for _, d in runs], report_dir=REPORT_DIR)
    except (ValueError, DiskFullError) as error:  # the runs stay: the same command compares them again at once
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(result["text"])
    winner = choose_winner(result, runs, args.decide, direction, rejected)
    verdict = (
        f"winner by {args.decide} ({direction} is better): {winner[0]} ({args.decide} = {winner[1]:.4g})"
        if winner
        else f"no winner: a gate rejected every run ({', '.join(sorted(rejected))})"
    )
    if rejected and winner:
        verdict += f"; rejected by a gate: {', '.join(sorted(rejected))}"
    print(verdict)
    report = Path(result["markdown"])
    report.write_text(report.read_text() + f"\n**{verdict}**\n")
    return 0


if __name__ == "__main__":
    from ..common.entry import run_tool

    sys.exit(run_tool(main, "python -m concept_encoder ablate"))
