"""The experiment engine the drivers share: planning points and arms, running and reusing them, writing reports.

The drivers `curve` (learning curves), `listops`, `long_context`, `recipes` and `recall` each measure a set of
points: a pretrained (or freshly configured) model fine-tuned and probed under the fair protocol (rate and step
chosen on dev, seeds, TF-IDF beside). This module holds what they do alike; each driver keeps its own arms, rows,
tables and plots:

- planning: token budgets as optimizer steps (`parse_budgets`, `one_budget`, `token_label`), an architecture's
  pretraining run and the models along it (`ArchitecturePlan`, `plan_architecture`, `kept_model`,
  `decayed_model`, `last_snapshot`; under wsd `wsd_stable_argv`), whether a finished run can be extended
  (`extension_problem`), a model to fine-tune from scratch (`scratch_model`), the flags a driver sets itself
  (`given_flags`, `refuse_driver_flags`, `without_flags`, `given_or_default`);
- running and reusing: the launches (`run_command`: tests replace it here, `pretrain`), a folder of points
  (`PointFolder`: each point a JSON file, measured once, reused after), the checks that a folder and its runs are
  this request's (`check_reuse`), one invocation a folder at a time (`exclusive`, `holding`);
- the command line and the reports: what every driver takes and checks before its first run
  (`add_report_driver_arguments`, `parse_driver_argv`, `check_finetune_argv`, `parse_list`,
  `parse_choices`, `usage_errors`), the report files (`write_report_files`, `print_report`) and what the
  reports read from a point (`chosen_runs`, `percent`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from ..checkpoints.checkpoint import checkpoint_dirs, step_of
from ..common import json_io, process_group
from ..common.cli_types import at_least
from ..common.differences import differences
from ..common.faults import written_whole
from ..common.metrics_log import read_metrics
from ..common.paths import PROJECT_ROOT, folder_problem, written_aside
from ..common.report_files import claim_report_stem
from ..data.base import DataSourceError
from ..model.bert_baseline import bert_config
from ..model.config import ConceptEncoderConfig
from ..model.presets import PRESETS
from ..tasks.leakage import planned_overlap
from ..tasks.loading import load_task
from ..training.args import FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS, parse_args
from ..training.plan import local_launcher
from ..training.resume import argument_settings, run_config_arguments
from ..training.runs import ended_on_its_own, stopped_by_gate, unfinished_launch

MLM_SCRIPT = PROJECT_ROOT / "loops" / "mlm.py"
FINETUNE_SCRIPT = PROJECT_ROOT / "loops" / "finetune.py"
SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}
MAX_TOKENS = 10**14  # a budget beyond this is a typo, not a plan: refused before anything runs
DRIVER_FLAGS = (
    "--max_steps",
    "--run_name",
    "--architecture",
    "--snapshot_steps",
    "--resume_from_checkpoint",
    "--checkpoint_steps",
)
FINETUNE_DRIVER_FLAGS = ("--model_name_or_path", "--task", "--run_name", "--report_dir", "--from_scratch",
                         "--compare_to", "--resume_from_checkpoint", "--probe", "--finetune")  # fmt: skip


def parse_budgets(text: str, flag: str = "--tokens") -> list[int]:
    """`"0.5M,2M,8M"` → [500000, 2000000, 8000000] (suffixes k, M, G/B; plain numbers too), ascending;
    ValueError naming `flag` and the bad entry."""
    budgets = []
    for item in (part.strip() for part in text.split(",")):
        match = re.fullmatch(r"(\d+\.?\d*(?:[eE][-+]?\d+)?)\s*([kKmMgGbB]?)", item)
        if not match:
            raise ValueError(f"{flag} {text!r}: {item!r} is not a token count such as 500k, 2M or 8000000")
        tokens = round(float(match[1]) * SUFFIXES[match[2].lower()])
        if tokens < 1:
            raise ValueError(f"{flag} {text!r}: {item!r} is not a positive token count")
        if tokens > MAX_TOKENS:
            raise ValueError(
                f"{flag} {text!r}: {item!r} is beyond {MAX_TOKENS:.0e} tokens, a run that "
                "cannot finish (the largest pretraining runs read about 15T); give a budget that can"
            )
        budgets.append(tokens)
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"{flag} {text!r}: a budget is given twice")
    return sorted(budgets)


def token_label(tokens: int) -> str:
    """500000 → "500k", 2000000 → "2M", 1234 → "1234": short, exact enough for names and axes."""
    for suffix, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if tokens >= size:
            return f"{tokens / size:.4g}{suffix}"
    return str(tokens)


@dataclass
class ArchitecturePlan:
    """One architecture's pretraining run and the points along it."""

    architecture: str
    run_name: str
    tokens_per_step: int
    steps: list[int]  # per budget, ascending
    pretrain_argv: list[str] = field(default_factory=list)
    loop_args: tuple = ()  # (model, data, training) arguments: pretrain_argv as the loop parses it
    decay_steps: int = 0  # wsd: each budget's decay, branched from the stable run (0: snapshots of one run)
    decay_argv: list[str] = field(default_factory=list)  # wsd: the loop arguments of every decay

    def tokens(self, step: int) -> int:
        return step * self.tokens_per_step

    @property
    def run_to(self) -> int:
        """The last step of the pretraining run (under wsd the stable run ends where the last decay branches)."""
        return self.steps[-1] - self.decay_steps

    def decay_command(self, step: int, resume: str) -> list[str]:
        """wsd: the loop arguments of the decay that ends at `step`, resuming from `resume`."""
        return [*self.decay_argv, "--run_name", f"{self.run_name}-decay{step}", "--max_steps", str(step),
                "--resume_from_checkpoint", resume]  # fmt: skip


WSD_FLAGS = ("--lr_scheduler_type", "--decay_steps", "--decay_type", "--min_lr_ratio")


def without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """`argv` without `flags` and their values (`--flag value` or `--flag=value`)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.split("=")[0] in flags:
            skip = "=" not in arg
        else:
            kept.append(arg)
    return kept


def wsd_stable_argv(loop_argv: list[str], train_args, steps: list[int]) -> list[str]:
    """The stable run of a wsd curve: the same arguments under a constant rate after the same warm-up, with a
    checkpoint kept at every budget's branch point; ValueError when a budget cannot branch in the stable phase."""
    decay, warmup = train_args.decay_steps, train_args.warmup_steps
    if not warmup and train_args.warmup_ratio:
        raise ValueError(
            "a wsd curve gives every budget the stable run's warm-up: give it in steps (--warmup_steps N, or "
            "--warmup_ratio 0), not as a ratio of one run's length"
        )
    if short := [step for step in steps if step - decay < max(warmup, 1)]:
        raise ValueError(
            f"--tokens: budgets of steps {short} end before warm-up ({warmup}) plus --decay_steps ({decay}) are done; "
            "choose larger budgets or a shorter decay"
        )
    return [*without_flags(loop_argv, WSD_FLAGS), "--lr_scheduler_type", "constant",
            "--checkpoint_steps", ",".join(str(step - decay) for step in steps)]  # fmt: skip


def given_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """Which of `flags` `argv` gives (`--flag value` or `--flag=value`), sorted."""
    return sorted({arg.split("=")[0] for arg in argv if arg.split("=")[0] in flags})


def refuse_driver_flags(argv: list[str], flags: tuple[str, ...], where: str, by: str) -> None:
    """ValueError when `argv` gives any of `flags`, which the driver sets itself: `<where> [flags] are set <by>;
    leave them out` (`where`: e.g. "pretraining arguments"; `by`: e.g. "by the curve driver")."""
    if taken := given_flags(argv, flags):
        raise ValueError(f"{where} {taken} are set {by}; leave them out")


def argv_settings(argv: list[str]) -> dict[str | None, list[str]]:
    """What a list of command-line arguments sets: `{flag: its values}`, the last `--flag` winning as argparse
    reads it (`--flag=value` split), whatever order the flags come in; values before any flag under None."""
    settings: dict[str | None, list[str]] = {}
    flag = None
    for arg in argv:
        if arg.startswith("--"):
            flag, equals, value = arg.partition("=")
            settings[flag] = [value] if equals else []
        else:
            settings.setdefault(flag, []).append(arg)
    return settings


def same_arguments(a, b) -> bool:
    """Whether `a` and `b` are lists of command-line arguments that set the same (`argv_settings`)."""
    lists = [isinstance(x, list) and all(isinstance(arg, str) for arg in x) for x in (a, b)]
    return all(lists) and argv_settings(a) == argv_settings(b)


def given_or_default(argv: list[str], defaults: dict[str, str]) -> list[str]:
    """`argv` with `defaults` (flag → value) appended for each flag it does not give."""
    given = set(given_flags(argv, tuple(defaults)))
    return [*argv, *(x for flag, value in defaults.items() if flag not in given for x in (flag, value))]


def plan_architecture(
    architecture: str, budgets: list[int], loop_argv: list[str], name: str, processes: int, flag: str = "--tokens"
):
    """The pretraining command for `architecture` (checked by the loop's own parser) and a step per budget;
    ValueError when two budgets round to the same step or a budget is under one step."""
    run_name = f"{name}-{architecture}"
    probe_args = parse_args([*loop_argv, "--architecture", architecture])
    _, data_args, train_args = probe_args
    per_step = (train_args.per_device_train_batch_size * train_args.gradient_accumulation_steps * processes
                * data_args.max_seq_length)  # fmt: skip
    steps = [max(1, round(tokens / per_step)) for tokens in budgets]
    if len(set(steps)) != len(steps) or any(tokens < per_step / 2 for tokens in budgets):
        raise ValueError(
            f"{flag} {','.join(map(token_label, budgets))}: one optimizer step is {per_step:,} tokens here, so the "
            f"budgets give steps {steps}; choose budgets at least one step apart (or a smaller batch)"
        )
    if train_args.lr_scheduler_type == "wsd":
        decay = train_args.decay_steps
        argv = [*wsd_stable_argv(loop_argv, train_args, steps), "--architecture", architecture, "--run_name", run_name,
                "--max_steps", str(steps[-1] - decay), "--resume_from_checkpoint", "auto"]  # fmt: skip
        plan = ArchitecturePlan(architecture, run_name, per_step, steps, argv, parse_args(argv), decay,
                                [*loop_argv, "--architecture", architecture])  # fmt: skip
        for step in steps:  # every decay's arguments as the loop checks them, before any run
            parse_args(plan.decay_command(step, "auto"))
        return plan, Path(train_args.output_dir) / run_name
    argv = [*loop_argv, "--architecture", architecture, "--run_name", run_name, "--max_steps", str(steps[-1]),
            "--snapshot_steps", ",".join(map(str, steps)), "--resume_from_checkpoint", "auto"]  # fmt: skip
    plan = ArchitecturePlan(architecture, run_name, per_step, steps, argv, parse_args(argv))  # checked before any run
    return plan, Path(train_args.output_dir) / run_name


def kept_model(plan: ArchitecturePlan, run_dir: Path, step: int) -> Path:
    """What a budget's point is made from along the pretraining run: the snapshot at `step`, or under wsd the
    stable run's checkpoint its decay branches from."""
    if plan.decay_steps:
        return run_dir / "checkpoints" / f"step_{step - plan.decay_steps:07d}"
    return run_dir / "snapshots" / f"step-{step}"


def scratch_model(target: Path, architecture: str, preset: str, positions: int, tokenizer, **concept_settings) -> Path:
    """`target`: a model to fine-tune from scratch, its config and `tokenizer` and no weights (fine-tuning builds
    them from the seed, `--from_scratch`): BERT or the Concept Encoder (with `concept_settings`, e.g. `concept_num`,
    `token_refinement`, `local_mixer`, `classifier_pooling`) of `preset`'s shape, at least `positions` long. Made
    once: a folder that holds a config is kept."""
    if (target / "config.json").is_file():
        return target
    shape = {**PRESETS[preset], "max_position_embeddings": max(PRESETS[preset]["max_position_embeddings"], positions)}
    if architecture == "bert":
        config = bert_config(shape, len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    else:
        ids = {name: getattr(tokenizer, name) for name in ("pad_token_id", "unk_token_id", "cls_token_id",
                                                           "sep_token_id", "mask_token_id")}  # fmt: skip
        config = ConceptEncoderConfig(**{**shape, **concept_settings}, vocab_size=len(tokenizer), **ids)
    target.parent.mkdir(parents=True, exist_ok=True)
    with written_aside(target, replace_existing=True) as partial:
        config.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
    return target


def last_snapshot(plan: ArchitecturePlan, run_dir: Path) -> Path:
    """The model a single-budget plan saved at its last step (the snapshot `plan_architecture` asks for)."""
    return run_dir / "snapshots" / f"step-{plan.steps[-1]}"


def decayed_model(plan: ArchitecturePlan, run_dir: Path, step: int, processes: int) -> Path | None:
    """wsd: the model of the budget ending at `step`: its decay run's final model, run (or resumed, or reused) from
    the stable run's checkpoint at the branch point; None when the stable run has no checkpoint there."""
    branch = run_dir.parent / f"{plan.run_name}-decay{step}"
    if ended_on_its_own(branch) and finished_steps(branch) >= step:
        return branch / "final"
    start = kept_model(plan, run_dir, step)
    resume = "auto" if checkpoint_dirs(branch) else str(start)
    if resume != "auto" and not start.is_dir():
        return None
    started = time.time()
    code = run_command([*local_launcher(MLM_SCRIPT, processes), *plan.decay_command(step, resume)])
    if why := unfinished_launch(branch, code, started):
        raise RuntimeError(f"the decay {branch.name} {why}; rerun (once fixed, if it failed): it resumes")
    return branch / "final"


def extension_problem(plan: ArchitecturePlan, run_dir: Path, finished: int) -> str | None:
    """Why pretraining run `run_dir`, finished at step `finished`, cannot be trained on to the plan's last
    step as if it had been planned that long from the start (None when it can: its schedule, `TrainingArguments.
    schedule`, is the same at both lengths, and a checkpoint is there to resume from). The loop's resume check
    refuses the same (`schedule` in the checkpoint's settings); here it is said before any run starts."""
    needed = plan.run_to
    start = (f"--tokens: {token_label(plan.tokens(needed))} needs step {needed}, but pretraining run {run_dir} "
             f"finished at step {finished}")  # fmt: skip
    ran, longer = (dataclasses.replace(plan.loop_args[2], max_steps=steps, snapshot_steps="", checkpoint_steps="").schedule
                   for steps in (finished, needed))  # (the snapshots are checked against the plan's own length)  # fmt: skip
    if ran["decays_to_step"] is not None:
        return (
            f"{start} under a {ran['lr_scheduler_type']} learning-rate schedule that decays to its own last step, so "
            "training it on is not the run a larger budget would have had; a curve meant to grow takes a schedule "
            "that does not depend on its length (`-- --lr_scheduler_type constant --warmup_steps N`); or measure "
            "under another --name"
        )
    if ran != longer:
        return (
            f"{start}, and its warm-up ({ran['warmup_steps']} steps, --warmup_ratio of the run's length) would "
            f"be {longer['warmup_steps']} steps in the longer run; give --warmup_steps N instead of a ratio, or "
            "measure under another --name"
        )
    if not checkpoint_dirs(run_dir):
        return (
            f"{start} and kept no checkpoint to continue from (none was due: --save_steps 0, or a run shorter than "
            "--save_steps); give the pretraining a --save_steps it reaches and "
            "measure under another --name"
        )
    return None


REQUEST = "request.json"  # in a point folder: what its points and pretraining runs were measured under
# all a point folder holds: what the drivers write (the long-context driver keeps its fine-tuning runs in `finetune/`)
SET_ASIDE = "set_aside"  # points moved out of `points` (`PointFolder.set_aside`)
FOLDER_ENTRIES = {REQUEST, ".lock", "points", "reports", "finetune", "tasks", "models", "curve.md", "curve.png",
                  "curve.json", SET_ASIDE}  # fmt: skip


def check_reuse(
    folder: Path,
    request: dict,
    plans: list[tuple[ArchitecturePlan, Path]],
    retired: tuple[str, ...] = (),
    record: bool = True,
    noun: str = "curve",
    folder_flag: str = "--curves_dir",
) -> None:
    """ValueError when the point folder `folder` (a curve's, or another driver's) was measured under another
    request (its points and runs would be reused as this one's), or when a budget needs more steps than a finished
    pretraining run took and the run cannot be extended as if planned that long (`extension_problem`); records the
    request for the next invocation (unless `record` is False: a report that reads the folder and runs nothing).
    `retired`: keys an older request recorded that no longer decide reuse (not compared, and dropped from the
    record). `noun` and `folder_flag` name the folder and its flag in messages (a recall map's: "map", `--runs_dir`)."""
    path = folder / REQUEST
    if record and (problem := folder_problem(folder, f"{folder_flag}/--name")):  # a file in the way, read-only
        raise ValueError(problem)
    if folder.is_symlink() or folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a link or a file, not a {noun} folder; choose another --name")
    if folder.is_dir() and (foreign := sorted({p.name for p in folder.iterdir()} - FOLDER_ENTRIES)):
        raise ValueError(f"{folder} holds files a {noun} does not write ({', '.join(foreign[:5])}): it is not a "
                         f"{noun} folder; choose another --name or {folder_flag}")  # fmt: skip
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
        except ValueError:
            saved = None
        if not isinstance(saved, dict):
            raise ValueError(f"{path} does not hold a request (a JSON object): the folder is damaged or not a "
                             "driver's; choose another --name")  # fmt: skip
        saved = {key: value for key, value in saved.items() if key not in retired}
        # command-line arguments in another order set the same: not a difference (`--finetune_args` written out)
        saved.update({key: request[key] for key, value in saved.items() if same_arguments(value, request.get(key))})
        if changed := differences(saved, request, f"the {noun}'s", "this invocation's"):
            raise ValueError(
                f"{noun} {folder.name} ({folder}) was measured under other settings ({'; '.join(changed)}): its "
                f"points and runs are not this request's; choose another --name or {folder_flag}"
            )
    for plan, run_dir in plans:
        if (run_dir / "config.json").is_file():  # a run of that name exists: this curve's only if run as it plans
            current = argument_settings(*plan.loop_args)
            saved = run_config_arguments(run_dir, current)
            if changed := differences(saved, current, "the run has", f"this {noun}", keys=sorted(saved)):
                raise ValueError(
                    f"pretraining run {run_dir} was run under other settings ({'; '.join(changed[:4])}): it is not "
                    f"this {noun}'s run; choose another --name (or move that run away)"
                )
        reached = max([finished_steps(run_dir) if (run_dir / "summary.json").is_file() else 0,
                       *(step_of(c) for c in checkpoint_dirs(run_dir))])  # fmt: skip
        for step in plan.steps:  # a budget added between steps the run has passed: no model of that step is left
            key = f"{plan.architecture}-{token_label(plan.tokens(step))}"
            kept = kept_model(plan, run_dir, step)
            if (
                step - plan.decay_steps <= reached
                and not kept.is_dir()
                and not (folder / "points" / f"{key}.json").is_file()
            ):
                raise ValueError(
                    f"--tokens: {token_label(plan.tokens(step))} is step {step}, which pretraining run {run_dir} has "
                    f"passed (it reached step {reached}) without a {'checkpoint' if plan.decay_steps else 'snapshot'} "
                    f"at {kept.name}: that model is not kept; measure it under another --name"
                )
        if ended_on_its_own(run_dir) and not stopped_by_gate(run_dir):
            steps = finished_steps(run_dir)
            if plan.run_to > steps and (problem := extension_problem(plan, run_dir, steps)):
                raise ValueError(problem)
    if record:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(json_io.dumps(request, indent=2))


def exclusive(folder: Path, what: str) -> FileLock | None:
    """The lock on `folder` (one invocation measures it at a time), acquired; None, with one line saying so, when
    another process holds it."""
    lock = FileLock(folder / ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"error: {what} is being measured by another process ({folder / '.lock'}); wait for it to finish, or "
              "choose another --name", file=sys.stderr)  # fmt: skip
        return None
    return lock


@dataclass
class Outcome:
    """How the runs under `holding` ended: `failed` when one failed (one line said why)."""

    failed: bool = False


@contextmanager
def holding(*locks: FileLock) -> Iterator[Outcome]:
    """The runs of a driver's folders under their `locks` (from `exclusive`), released however they end; a run
    that fails (a RuntimeError) is one line `error: ...` and `failed` (finished runs and points stay: the same
    command continues)."""
    outcome = Outcome()
    try:
        yield outcome
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        outcome.failed = True
    finally:
        for lock in locks:
            lock.release()


def write_report_files(report: dict, report_dir: str, prefix: str, markdown, plot) -> dict[str, Path]:
    """A driver's report as `<prefix>_<time>.{md,json,png}` under `report_dir` (`markdown(report)` → text,
    `plot(report, path)`), written whole: a failure leaves none of them."""
    stem = claim_report_stem(report_dir, prefix)
    paths = {ext: Path(f"{stem}.{ext}") for ext in ("md", "json", "png")}
    with written_whole(list(paths.values()), f"the report {stem.name}.*"):
        paths["md"].write_text(markdown(report))
        paths["json"].write_text(json_io.dumps(report, indent=2, default=str))
        plot(report, paths["png"])
    return paths


def print_report(paths: dict[str, Path], label: str = "report") -> None:
    """A report `write_report_files` wrote, on the terminal: its markdown, then one line `<label>: <its files>`."""
    print(paths["md"].read_text())
    print(f"{label}: {paths['md']}, {paths['json']}, {paths['png']}", flush=True)


def chosen_runs(point: dict) -> tuple[dict, list[dict]]:
    """A point's fine-tuning report row and its runs at the rate chosen on dev (one per seed)."""
    (row,) = [r for r in point["rows"] if r["method"] == "fine-tune"]
    runs = [r for r in point.get("runs", []) if r.get("method") == "fine-tune"]
    return row, [r for r in runs if r["learning_rate"] == row["learning_rate"]]


def point_config(point: dict) -> dict:
    """The config of the model a point measured: kept in the point (`PointFolder.measure`); a point written before
    it was reads its model folder, and one whose folder is gone (restored from an archive) is a clear error."""
    if point.get("model_config"):
        return dict(point["model_config"])
    path = Path(point["model"]) / "config.json"
    if not path.is_file():
        raise ValueError(f"point {point['key']} keeps no model config and its model {point['model']} is gone (a point "
                         "from an archive written before points kept it): delete the point to measure it again")  # fmt: skip
    return json.loads(path.read_text())


def percent(value, std=None) -> str:
    """A fraction (and its std) as a report's percentage, `12.34 ± 0.56`; `-` for a value not measured."""
    if value is None:
        return "-"
    return f"{100 * value:.2f}" + (f" ± {100 * std:.2f}" if std is not None else "")


def run_command(command: list[str]) -> int:
    """One `accelerate launch` of a loop; its exit code (tests replace this to run the loops in process). Ctrl-C
    stops the loop's ranks at a checkpoint, not the launcher (`process_group.call_interrupting_ranks`)."""
    return process_group.call_interrupting_ranks(command)


class PointFolder:
    """The points of one experiment on disk (a curve's `Cache/curves/<name>/`, a driver's `<runs_dir>/<name>/`), and
    the runs that make missing ones."""

    def __init__(self, folder: Path, task: str, finetune_argv: list[str], processes: int, probe: bool = True,
                 archive: Path | None = None):  # fmt: skip
        self.folder, self.task, self.finetune_argv, self.processes = folder, task, finetune_argv, processes
        self.probe = probe  # linear probes beside fine-tuning at every point
        self.archive = archive  # a copy of the points kept elsewhere (`--archive`): `restore`, `keep`
        self.named: set[str] = set()  # damaged points already named

    def point_file(self, key: str) -> Path:
        return self.folder / "points" / f"{key}.json"

    def done(self, key: str) -> bool:
        """Whether `key` was measured: its point file holds what `measure` writes (a damaged one is named and
        measured again)."""
        path = self.point_file(key)
        if not path.is_file():
            return False
        if problem := point_problem(path):
            if key not in self.named:  # once per invocation
                print(f"{path} {problem}: measuring the point again", file=sys.stderr)
                self.named.add(key)
            return False
        return True

    def measure(self, key: str, model: str, extra: list[str], info: dict, threads: int | None = None,
                keep: bool = True) -> dict:  # fmt: skip
        """Fine-tune and probe `model` under the fair protocol (resuming an interrupted attempt); the point's
        report rows and baselines go to `points/<key>.json` once all of it finished, and into the archive (`keep`).
        `threads`: each rank's CPU threads pinned (`CPU_THREADS` for this launch alone, set through `env` so launches
        beside it keep theirs) and the runs named for it (`<name>-<key>-t<threads>`), so runs of two counts, whose
        CPU sums differ, are never taken for each other."""
        reports = self.folder / "reports" / key
        run_name = f"{self.folder.name}-{key}" + (f"-t{threads}" if threads else "")
        argv = [*self.finetune_argv, "--model_name_or_path", model, "--task", self.task,
                *(["--probe"] if self.probe else []), "--run_name", run_name, "--report_dir", str(reports),
                *extra]  # fmt: skip
        earlier = report_stamps(reports)  # a report left by an earlier attempt is not this one's
        pinned = ["env", f"CPU_THREADS={threads}"] if threads else []
        # auto: a fresh start the first time; after an interruption, finished seeds reused, the cut one resumed
        code = run_command(
            [*pinned, *local_launcher(FINETUNE_SCRIPT, self.processes), *argv, "--resume_from_checkpoint", "auto"]
        )
        found = sorted((p for p, stamp in report_stamps(reports).items() if earlier.get(p) != stamp),
                       key=lambda p: p.stat().st_mtime_ns)  # written by this run, the newest last  # fmt: skip
        if code != 0 or not found:
            why = f"exit code {code}" if code else "exit code 0 but no report"
            raise RuntimeError(f"fine-tuning {model} for point {key} did not finish ({why}: it failed, or a signal "
                               "stopped it at a checkpoint); rerun (once fixed, if it failed): finished points are "
                               "reused, an interrupted run resumes")  # fmt: skip
        report = json.loads(found[-1].read_text())
        config = Path(model) / "config.json"  # kept: a restored point's model folder may be on another machine
        point = {"key": key, "model": model, **info, "extra": extra, "rows": report["rows"],
                 "baselines": report["baselines"], "runs": report["runs"],
                 "model_config": json.loads(config.read_text()) if config.is_file() else None}  # fmt: skip
        self.point_file(key).parent.mkdir(parents=True, exist_ok=True)
        with written_aside(self.point_file(key)) as partial:  # a reader (`--report_only`) never sees half of it
            partial.write_text(json_io.dumps(point, indent=2))
        if keep:
            self.keep(key)
        return point

    def set_aside(self, key: str) -> Path:
        """Move the point `key` out of the points (never deleted, never archived) to `set_aside/<key>-<time>.json`,
        so the next invocation measures it again; its new path."""
        target = self.folder / SET_ASIDE / f"{key}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        self.point_file(key).replace(target)
        return target

    def reused_or_measured(self, key: str, model: str, extra: list[str], info: dict, what: str) -> dict:
        """The point `key`: read when measured before with the same fine-tuning arguments `extra` (e.g. a cell's
        `--seeds`), else measured (`measure`: the fine-tuning runs that match are reused, so more seeds run only the
        new ones); one line says which. Either way it is kept in the archive (`keep`, as `measure` does)."""
        if self.done(key):
            point = json.loads(self.point_file(key).read_text())
            if not (changed := point_changes(point, extra)):
                print(f"{key}: finished earlier, reused", flush=True)
                self.keep(key)
                return point
            print(f"{key}: measured earlier under other settings ({'; '.join(changed)}): measuring it again (its "
                  "fine-tuning runs that match are reused)", flush=True)  # fmt: skip
        else:
            print(f"{key}: {what}", flush=True)
        return self.measure(key, model, extra, info)

    def finished(self, key: str, extra: list[str]) -> dict | None:
        """The point `key` when it was measured under these fine-tuning arguments `extra`, else None (missing,
        damaged, being written, or measured under others): what a report of the points so far reads, running
        nothing."""
        path = self.point_file(key)
        if not path.is_file() or point_problem(path):
            return None
        point = json.loads(path.read_text())  # whole: points are moved into place once written
        return None if point_changes(point, extra) else point

    def restore_from(self, archive: Path) -> list[str]:
        """Copy in the points `archive` (a copy of this folder's points and request, e.g. under version control: a
        fresh machine's Cache is empty) holds and this folder lacks or holds damaged; their keys. Whether the
        archive was measured under this request is the caller's check (`check_reuse` on it, before anything runs);
        a point measured under other fine-tuning arguments is restored and then measured again, as here."""
        restored = []
        for source in sorted((archive / "points").glob("*.json")):
            target = self.folder / "points" / source.name
            if point_problem(source) or target.is_file() and not point_problem(target):
                continue  # a damaged copy is not restored; a whole point here is this machine's, kept
            copy_whole(source, target)
            restored.append(source.stem)
        if restored and not (self.folder / REQUEST).is_file() and (archive / REQUEST).is_file():
            copy_whole(archive / REQUEST, self.folder / REQUEST)  # checked equal to this request by the caller
        return restored

    def restore(self) -> list[str]:
        """`restore_from` the folder's archive (none: nothing)."""
        return self.restore_from(self.archive) if self.archive else []

    def keep(self, key: str) -> None:
        """`keep_in` the folder's archive, when it has one."""
        if self.archive:
            self.keep_in(self.archive, key)

    def keep_in(self, archive: Path, key: str) -> None:
        """Copy the finished point `key` and the folder's request into `archive` (`restore_from` reads them)."""
        for name in (REQUEST, f"points/{key}.json"):
            source, target = self.folder / name, archive / name
            if source.is_file() and not (target.is_file() and target.read_bytes() == source.read_bytes()):
                copy_whole(source, target)

    def points(self) -> list[dict]:
        """The points measured (a damaged file is left out: `done` names it)."""
        return [
            json.loads(p.read_text()) for p in sorted((self.folder / "points").glob("*.json")) if not point_problem(p)
        ]


def copy_whole(source: Path, target: Path) -> None:
    """`source`'s bytes to `target` (its folder made), moved into place once written: no reader sees half."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with written_aside(target) as partial:
        partial.write_bytes(source.read_bytes())


def report_stamps(folder: Path) -> dict[Path, int]:
    """Each fine-tuning report in `folder` → its modification time (ns): what tells a new or rewritten report
    from one an earlier attempt left."""
    return {p: p.stat().st_mtime_ns for p in folder.glob("finetune_*.json")}


def point_changes(point: dict, extra: list[str]) -> list[str]:
    """What differs between the fine-tuning arguments a point was measured with and this request's (`extra`: a
    cell's `--seeds`, a twin's `--from_scratch`); a point written before they were saved is not compared. Its
    `info` is description, not settings: points shared by several arms (a recipe's twin) carry the first one's."""
    if "extra" not in point or point["extra"] == extra:
        return []
    return differences({"fine-tuning arguments": point["extra"]}, {"fine-tuning arguments": extra}, "then", "now")


def point_problem(path: Path) -> str | None:
    """Why `path` does not hold a point as `PointFolder.measure` writes it (JSON object named by its key, rows and
    baselines, whole-number tokens and step for a snapshot), else None."""
    try:
        point = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return f"is not readable JSON ({error})"
    if not isinstance(point, dict) or point.get("key") != path.stem:
        return f"does not hold the point {path.stem!r}"
    if not isinstance(point.get("rows"), list) or not isinstance(point.get("baselines"), dict):
        return "lacks its rows or baselines"
    if point.get("kind") == "snapshot" and not all(
        isinstance(point.get(k), int) and not isinstance(point.get(k), bool) for k in ("tokens", "step")
    ):
        return "holds tokens or a step that are not whole numbers"
    return None


def evaluation_at(run_dir: Path, step: int) -> dict:
    """The pretraining run's MLM eval loss and accuracy over the unigram baseline at `step` (the loop evaluates
    at every snapshot step); None for what was not recorded."""
    path = run_dir / "metrics.jsonl"
    found = [r for r in read_metrics(path) if r["kind"] == "eval" and r["step"] == step] if path.is_file() else []
    last = found[-1] if found else {}
    return {"eval_loss": last.get("eval_loss"), "unigram_ratio": last.get("eval_accuracy_over_unigram")}


def finished_steps(run_dir: Path) -> int:
    """The steps a finished run took (its `summary.json`)."""
    return json.loads((run_dir / "summary.json").read_text()).get("steps", 0)


def pretrain(plan: ArchitecturePlan, run_dir: Path, processes: int) -> dict:
    """Run (or resume, or reuse, or extend to a budget added later) the architecture's pretraining; returns
    what ended it. An extension resumes the run's newest checkpoint with the larger `--max_steps`: under a
    schedule that does not depend on the run's length (`extension_problem` checked it) that is the run a larger
    budget would have had from the start, so the points measured before stay valid."""
    ended = ended_on_its_own(run_dir)
    if ended and not stopped_by_gate(run_dir) and (steps := finished_steps(run_dir)) < plan.run_to:
        print(f"extending {plan.run_name} from step {steps} to {plan.run_to} (a budget added)")
        ended = False
    if not ended:
        started = time.time()
        code = run_command([*local_launcher(MLM_SCRIPT, processes), *plan.pretrain_argv])
        if why := unfinished_launch(run_dir, code, started):
            raise RuntimeError(f"pretraining {plan.run_name} {why}; rerun the same command (once fixed, if it "
                               "failed): it resumes from the newest checkpoint")  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"stopped_by_gate": bool(summary.get("stopped_by_gate")), "steps": summary["steps"],
            "gates": summary.get("gates", [])}  # fmt: skip


def add_report_driver_arguments(parser: argparse.ArgumentParser, name: str, runs_dir: str) -> None:
    """What every driver that writes `Cache/reports/<name>_<time>.*` from fine-tuned points takes beside its own."""
    parser.add_argument("--finetune_args", default="", help='arguments for loops/finetune.py, e.g. "--seeds 3"')
    parser.add_argument("--name", default=name)
    parser.add_argument("--runs_dir", default=runs_dir, help="where the runs' points are kept")
    parser.add_argument("--report_dir", default="Cache/reports")
    parser.add_argument("--num_processes", type=at_least(1), default=1, help="processes per run (accelerate launch)")


def add_archive_argument(parser: argparse.ArgumentParser, what: str, example: str) -> None:
    """`--archive`: a second home for a driver's points (`PointFolder.archive`)."""
    parser.add_argument("--archive", default=None,
                        help=f"a folder that keeps a copy of the {what}'s points (e.g. {example}, under version "
                             "control: a fresh machine's Cache is empty): points found there are reused, each "
                             "finished point is copied there")  # fmt: skip


def check_archive(archive: Path, request: dict, retired: tuple[str, ...] = (), noun: str = "archive") -> None:
    """ValueError, before any run, when the archived folder `archive` was measured under another request (its
    points would be restored as this one's) or nothing can be written there (every finished point is copied in)."""
    check_reuse(archive, request, [], retired, record=False, noun=noun, folder_flag="--archive")
    if problem := folder_problem(archive, "--archive"):
        raise ValueError(problem)


def add_jobs_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--jobs`, for a driver whose `what` (cells, arms) are independent fine-tuning points."""
    parser.add_argument("--jobs", type=at_least(1), default=1,
                        help=f"{what} measured at once (one-process launches), the CPU cores split between them "
                             "(CPU_THREADS, unless set; on a GPU machine they share the GPU): on 2 cores, --jobs 2 "
                             "trains about 1.5 times the steps of --jobs 1 at the micro shape (docs/recall.md)")  # fmt: skip


def check_jobs(args) -> None:
    """`--jobs` above 1 only for one-process launches: each multi-process launch would take the same rendezvous
    port (ValueError, before anything runs)."""
    if args.jobs > 1 and args.num_processes > 1:
        raise ValueError(f"--jobs {args.jobs} with --num_processes {args.num_processes}: launches side by side would "
                         "share one rendezvous port; --jobs runs one-process launches at once, so give one of the "
                         "two as 1")  # fmt: skip


def measure_at_once(jobs: list, args, what: str, pending: int) -> list:
    """`jobs` (each measuring one point, `pending` of them not measured yet) run `--jobs` at a time
    (`process_group.run_at_once`), their results in order. While more than one measures, the cores are split
    between their launches (`runtime.cores_shared`); with one left to measure it has them all."""
    at_once = min(args.jobs, pending)
    if at_once <= 1:
        return process_group.run_at_once(jobs, args.jobs)
    from ..training.runtime import cores_shared, usable_cores

    with cores_shared(at_once) as threads:
        print(f"--jobs {args.jobs}: {what} measured {at_once} at a time, {threads} CPU thread(s) each", flush=True)
        if at_once * threads > (cores := usable_cores()):
            print(f"warning: --jobs {args.jobs}: {at_once} launches x {threads} thread(s) on {cores} cores: they "
                  f"share cores, each slower than alone (--jobs {max(1, cores // threads)} fits)", file=sys.stderr)  # fmt: skip
        return process_group.run_at_once(jobs, args.jobs)


def check_finetune_argv(
    finetune_argv: list[str], task: str, datasets: Iterable[str] = (), driver: str = "curve"
) -> None:
    """The fine-tuning arguments as the loop will see them (a placeholder model), before anything runs; and that
    no pretraining on `datasets` reads a text the task's dev or validation split holds (`task:` sources)."""
    refuse_driver_flags(finetune_argv, FINETUNE_DRIVER_FLAGS, "--finetune_args:", f"by the {driver} driver")
    _, task_args, _ = parse_args(["--model_name_or_path", ".", "--task", task, *finetune_argv],
                                 classes=FINETUNE_ARGUMENT_CLASSES, defaults=FINETUNE_DEFAULTS)  # fmt: skip
    try:  # the task must load before hours of pretraining are spent on it
        data = load_task(task_args)
    except DataSourceError as error:
        raise ValueError(str(error)) from error
    if data.whole_input:  # never cut (`encode_splits`): a symbol is a token at least, with [CLS] and [SEP]
        splits = (data.train, data.dev, data.validation)
        longest = max(len(text.split()) for split in splits for text in split["text_a"]) + 2
        if longest > task_args.max_seq_length:
            raise ValueError(f"--finetune_args: task {task} has examples of at least {longest} tokens, longer than "
                             f"--max_seq_length {task_args.max_seq_length}, and is never truncated; pass "
                             f"--max_seq_length {longest} (or more) in --finetune_args")  # fmt: skip
    for dataset in dict.fromkeys(datasets):
        if problem := planned_overlap(dataset, data):
            raise ValueError(problem)


def parse_driver_argv(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple:
    """A driver's command line: (its own arguments parsed, the pretraining arguments after `--`, its
    `--finetune_args` split as a shell would)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, loop_argv = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    try:
        return args, loop_argv, shlex.split(args.finetune_args)
    except ValueError as error:  # an unbalanced quote: a usage line, not a traceback
        parser.error(f"--finetune_args {args.finetune_args!r}: {error}; quote it as a shell would")


def parse_list(text: str, what: str, convert=str) -> list:
    """`a,b,c` → its distinct values, each through `convert`; ValueError naming `what` for a value `convert`
    refuses (e.g. `--concepts 16,x`), an empty list or a repeated value."""
    try:
        values = [convert(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        kind = "whole numbers" if convert is int else "values"
        raise ValueError(f"{what} {text!r}: give distinct comma-separated {kind}, e.g. 16,64") from None
    if not values or len(set(values)) != len(values):
        raise ValueError(f"{what} {text!r}: give distinct comma-separated values")
    return values


def parse_choices(text: str, flag: str, allowed) -> list[str]:
    """`flag`'s `a,b` → the distinct choices it names, in its order, each one of `allowed` (a driver's axis: its
    architectures, mixers, presets, rows, arms); ValueError naming the flag, the unknown ones and the choices."""
    chosen = parse_list(text, flag)
    if bad := [c for c in chosen if c not in allowed]:
        raise ValueError(f"{flag} {text!r}: {bad} unknown; choose from {tuple(allowed)}")
    return chosen


def one_budget(text: str, why: str, flag: str = "--tokens") -> int:
    """`flag` of a driver whose runs all take one budget: that budget; ValueError saying `why` for several."""
    budgets = parse_budgets(text, flag)
    if len(budgets) != 1:
        raise ValueError(f"{flag} {text!r}: give one budget ({why})")
    return budgets[0]


@contextmanager
def usage_errors(parser: argparse.ArgumentParser) -> Iterator[None]:
    """The checks a driver makes before its first run: a ValueError among them (a `ReportFolderError` is one)
    ends the program as a usage error, one line and exit code 2."""
    try:
        yield
    except ValueError as error:
        parser.exit(2, f"usage error: {error}\n")
