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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

from ..common import json_io, process_group
from ..common.cli_types import at_least
from ..common.paths import PROJECT_ROOT, cache_path, folder_problem
from ..common.report_files import claim_report_stem
from ..constants import ARCHITECTURES
from ..data.base import DataSourceError
from ..data.sources import source_fingerprint
from ..tasks.leakage import planned_overlap
from ..tasks.loading import load_task
from ..training.args import FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS, parse_args
from ..training.checkpoint import (
    argument_settings,
    checkpoint_dirs,
    differences,
    run_config_arguments,
    step_of,
)
from ..training.faults import written_whole
from ..training.metrics_log import read_metrics
from ..training.model_folder import model_digest, model_folder_problem
from ..training.plan import local_launcher
from ..training.runs import ended_on_its_own, stopped_by_gate

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


def parse_budgets(text: str) -> list[int]:
    """`"0.5M,2M,8M"` → [500000, 2000000, 8000000] (suffixes k, M, G/B; plain numbers too), ascending;
    ValueError naming the bad entry."""
    budgets = []
    for item in (part.strip() for part in text.split(",")):
        match = re.fullmatch(r"(\d+\.?\d*(?:[eE][-+]?\d+)?)\s*([kKmMgGbB]?)", item)
        if not match:
            raise ValueError(f"--tokens {text!r}: {item!r} is not a token count such as 500k, 2M or 8000000")
        tokens = round(float(match[1]) * SUFFIXES[match[2].lower()])
        if tokens < 1:
            raise ValueError(f"--tokens {text!r}: {item!r} is not a positive token count")
        if tokens > MAX_TOKENS:
            raise ValueError(
                f"--tokens {text!r}: {item!r} is beyond {MAX_TOKENS:.0e} tokens, a run that "
                "cannot finish (the largest pretraining runs read about 15T); give a budget that can"
            )
        budgets.append(tokens)
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"--tokens {text!r}: a budget is given twice")
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
    return sorted({arg.split("=")[0] for arg in argv if arg.split("=")[0] in flags})


def plan_architecture(architecture: str, budgets: list[int], loop_argv: list[str], name: str, processes: int):
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
            f"--tokens {','.join(map(token_label, budgets))}: one optimizer step is {per_step:,} tokens here, so the "
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
    code = run_command([*local_launcher(MLM_SCRIPT, processes), *plan.decay_command(step, resume)])
    if code != 0:
        raise RuntimeError(f"the decay {branch.name} failed (exit code {code}); fix it and rerun: it resumes")
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


REQUEST = "request.json"  # in the curve's folder: what its points and pretraining runs were measured under
# all a curve (or the long-context driver, which keeps its fine-tuning runs in `finetune/`) writes
CURVE_ENTRIES = {REQUEST, ".lock", "points", "reports", "finetune", "tasks", "models", "curve.md", "curve.png",
                 "curve.json"}  # fmt: skip


def curve_request(args, loop_argv: list[str], finetune_argv: list[str]) -> dict:
    """Everything that decides a point's result, budgets aside: the task (and a local task file's content
    fingerprint), the fine-tuning and pretraining arguments, the processes, the reference (and its weights'
    digest: the same folder may hold another model by now)."""
    local = Path(args.task).expanduser().exists()
    return {"task": args.task, "task_files": source_fingerprint(args.task) if local else None,
            "finetune_args": finetune_argv, "pretrain_args": loop_argv, "num_processes": args.num_processes,
            "reference": args.reference,
            "reference_sha256": model_digest(args.reference) if args.reference else None}  # fmt: skip


def check_reuse(folder: Path, request: dict, plans: list[tuple[ArchitecturePlan, Path]]) -> None:
    """ValueError when the curve at `folder` was measured under another request (its points and runs would be
    reused as this one's), or when a budget needs more steps than a finished pretraining run took and the run
    cannot be extended as if planned that long (`extension_problem`); records the request for the next
    invocation."""
    path = folder / REQUEST
    if problem := folder_problem(folder, "--curves_dir/--name"):  # a file in the way, read-only: before any run
        raise ValueError(problem)
    if folder.is_symlink() or folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} is a link or a file, not a curve folder; choose another --name")
    if folder.is_dir() and (foreign := sorted({p.name for p in folder.iterdir()} - CURVE_ENTRIES)):
        raise ValueError(f"{folder} holds files a curve does not write ({', '.join(foreign[:5])}): it is not a curve "
                         "folder; choose another --name or --curves_dir")  # fmt: skip
    if path.is_file():
        saved = json.loads(path.read_text())
        if changed := differences(saved, request, "the curve's", "this invocation's"):
            raise ValueError(
                f"curve {folder.name} ({folder}) was measured under other settings ({'; '.join(changed)}): its "
                "points and pretraining runs are not this request's; choose another --name"
            )
    for plan, run_dir in plans:
        if (run_dir / "config.json").is_file():  # a run of that name exists: this curve's only if run as it plans
            current = argument_settings(*plan.loop_args)
            saved = run_config_arguments(run_dir, current)
            if changed := differences(saved, current, "the run has", "this curve", keys=sorted(saved)):
                raise ValueError(
                    f"pretraining run {run_dir} was run under other settings ({'; '.join(changed[:4])}): it is not "
                    "this curve's run; choose another --name (or move that run away)"
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


def run_command(command: list[str]) -> int:
    """One `accelerate launch` of a loop; its exit code (tests replace this to run the loops in process). Ctrl-C
    stops the loop's ranks at a checkpoint, not the launcher (`process_group.call_interrupting_ranks`)."""
    return process_group.call_interrupting_ranks(command)


class Curve:
    """The points of one curve on disk (`Cache/curves/<name>/`), and the runs that make missing ones."""

    def __init__(self, folder: Path, task: str, finetune_argv: list[str], processes: int, probe: bool = True):
        self.folder, self.task, self.finetune_argv, self.processes = folder, task, finetune_argv, processes
        self.probe = probe  # linear probes beside fine-tuning at every point
        self.named: set[str] = set()  # damaged points already named
        (folder / "points").mkdir(parents=True, exist_ok=True)

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

    def measure(self, key: str, model: str, extra: list[str], info: dict) -> dict:
        """Fine-tune and probe `model` under the fair protocol (resuming an interrupted attempt); the point's
        report rows and baselines go to `points/<key>.json` once all of it finished."""
        reports = self.folder / "reports" / key
        argv = [*self.finetune_argv, "--model_name_or_path", model, "--task", self.task,
                *(["--probe"] if self.probe else []), "--run_name", f"{self.folder.name}-{key}",
                "--report_dir", str(reports), *extra]  # fmt: skip
        # auto: a fresh start the first time; after an interruption, finished seeds reused, the cut one resumed
        code = run_command(
            [*local_launcher(FINETUNE_SCRIPT, self.processes), *argv, "--resume_from_checkpoint", "auto"]
        )
        found = sorted(reports.glob("finetune_*.json"), key=lambda p: p.stat().st_mtime_ns)  # the newest last
        if code != 0 or not found:
            raise RuntimeError(f"fine-tuning {model} for point {key} failed (exit code {code}); fix it and rerun: "
                               "finished points are reused")  # fmt: skip
        report = json.loads(found[-1].read_text())
        point = {"key": key, "model": model, **info, "rows": report["rows"], "baselines": report["baselines"],
                 "runs": report["runs"]}  # fmt: skip
        self.point_file(key).write_text(json_io.dumps(point, indent=2))
        return point

    def reused_or_measured(self, key: str, model: str, extra: list[str], info: dict, what: str) -> dict:
        """The point `key`: read when measured before, else measured (`measure`); one line says which."""
        if self.done(key):
            print(f"{key}: finished earlier, reused", flush=True)
            return json.loads(self.point_file(key).read_text())
        print(f"{key}: {what}", flush=True)
        return self.measure(key, model, extra, info)

    def points(self) -> list[dict]:
        """The points measured (a damaged file is left out: `done` names it)."""
        return [
            json.loads(p.read_text()) for p in sorted((self.folder / "points").glob("*.json")) if not point_problem(p)
        ]


def point_problem(path: Path) -> str | None:
    """Why `path` does not hold a point as `Curve.measure` writes it (JSON object named by its key, rows and
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
        code = run_command([*local_launcher(MLM_SCRIPT, processes), *plan.pretrain_argv])
        if code != 0 and not stopped_by_gate(run_dir):
            raise RuntimeError(f"pretraining {plan.run_name} failed (exit code {code}); fix it and rerun the same "
                               "command: it resumes from the newest checkpoint")  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"stopped_by_gate": bool(summary.get("stopped_by_gate")), "steps": summary["steps"],
            "gates": summary.get("gates", [])}  # fmt: skip


def main_metric(rows: list[dict]) -> str:
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
    if entry is None:
        return ""
    spread = f" ± {entry['std']:.3f}" if len(entry["seeds"]) > 1 else ""
    rate = f" (lr {entry['learning_rate']:g}{', still improving' if entry['still_improving'] else ''})" if (
        entry["learning_rate"]) else ""  # fmt: skip
    return f"{entry['mean']:.3f}{spread}{rate}"


def format_markdown(summary: dict, task: str, name: str) -> str:
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


def add_report_driver_arguments(parser: argparse.ArgumentParser, name: str, runs_dir: str) -> None:
    """What every driver that writes `Cache/reports/<name>_<time>.*` from fine-tuned points takes beside its own."""
    parser.add_argument("--finetune_args", default="", help='arguments for loops/finetune.py, e.g. "--seeds 3"')
    parser.add_argument("--name", default=name)
    parser.add_argument("--runs_dir", default=runs_dir, help="where the runs' points are kept")
    parser.add_argument("--report_dir", default="Cache/reports")
    parser.add_argument("--num_processes", type=at_least(1), default=1, help="processes per run (accelerate launch)")


def build_parser() -> argparse.ArgumentParser:
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
    parser.add_argument("--twins", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                        help="also the from-scratch twin of each architecture (default true)")  # fmt: skip
    parser.add_argument("--num_processes", type=at_least(1), default=1, help="processes per run (accelerate launch)")
    return parser


def check_finetune_argv(finetune_argv: list[str], task: str, datasets: Iterable[str] = ()) -> None:
    """The fine-tuning arguments as the loop will see them (a placeholder model), before anything runs; and that
    no pretraining on `datasets` reads a text the task's dev or validation split holds (`task:` sources)."""
    taken = given_flags(finetune_argv, FINETUNE_DRIVER_FLAGS)
    if taken:
        raise ValueError(f"--finetune_args: {taken} are set by the curve driver; leave them out")
    _, task_args, _ = parse_args(["--model_name_or_path", ".", "--task", task, *finetune_argv],
                                 classes=FINETUNE_ARGUMENT_CLASSES, defaults=FINETUNE_DEFAULTS)  # fmt: skip
    try:  # the task must load before hours of pretraining are spent on it
        data = load_task(task_args)
    except DataSourceError as error:
        raise ValueError(str(error)) from error
    for dataset in dict.fromkeys(datasets):
        if problem := planned_overlap(dataset, data):
            raise ValueError(problem)


def parse_driver_argv(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple:
    """A driver's command line: (its own arguments parsed, the pretraining arguments after `--`, its
    `--finetune_args` split as a shell would)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, loop_argv = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    return args, loop_argv, shlex.split(args.finetune_args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, loop_argv, finetune_argv = parse_driver_argv(parser, argv)
    try:  # every check before the first run starts
        budgets = parse_budgets(args.tokens)
        architectures = [a.strip() for a in args.architectures.split(",") if a.strip()]
        if not architectures or any(a not in ARCHITECTURES for a in architectures):
            raise ValueError(f"--architectures {args.architectures!r}: choose from {ARCHITECTURES}")
        taken = given_flags(loop_argv, DRIVER_FLAGS)
        if taken:
            raise ValueError(f"pretraining arguments {taken} are set by the curve driver; leave them out")
        if args.reference and (problem := model_folder_problem(args.reference)):
            raise ValueError(f"--reference: {problem} (make reference fetches the positive control)")
        plans = [plan_architecture(a, budgets, loop_argv, args.name, args.num_processes) for a in architectures]
        check_finetune_argv(finetune_argv, args.task, [plan.loop_args[1].dataset for plan, _ in plans])
        check_reuse(cache_path(args.curves_dir) / args.name, curve_request(args, loop_argv, finetune_argv), plans)
    except ValueError as error:
        parser.exit(2, f"usage error: {error}\n")
    curve = Curve(cache_path(args.curves_dir) / args.name, args.task, finetune_argv, args.num_processes)
    total = len(plans) * (len(budgets) + args.twins) + bool(args.reference)
    progress = iter(range(1, total + 1))
    gate_notes = {}

    def announce(key: str, what: str) -> None:
        print(f"[{next(progress)}/{total}] {key}: {what}", flush=True)

    lock = exclusive(curve.folder, f"curve {args.name}")  # a second invocation would train the same runs
    if lock is None:
        return 1
    try:
        for plan, run_dir in plans:
            keys = [f"{plan.architecture}-{token_label(plan.tokens(step))}" for step in plan.steps]
            pending = [k for k in keys if not curve.done(k)]
            ended = pretrain(plan, run_dir, args.num_processes) if pending else None
            if ended and ended["stopped_by_gate"]:
                failed = "; ".join(g.get("gate", str(g)) for g in ended["gates"] if g.get("passed") is False)
                gate_notes[plan.architecture] = f"pretraining stopped by a gate at step {ended['steps']} ({failed})"
            for key, step in zip(keys, plan.steps, strict=True):
                snapshot = kept_model(plan, run_dir, step)
                if not curve.done(key) and plan.decay_steps and snapshot.is_dir():  # wsd: the budget's own decay
                    print(f"{key}: decay of {plan.decay_steps} steps to step {step} from {snapshot}", flush=True)
                    evaluated_in = run_dir.parent / f"{plan.run_name}-decay{step}"
                    snapshot = decayed_model(plan, run_dir, step, args.num_processes)
                else:
                    evaluated_in = run_dir
                if curve.done(key):
                    announce(key, "finished earlier, reused")
                elif snapshot is None or not snapshot.is_dir():
                    announce(
                        key, f"no snapshot at step {step}: {gate_notes.get(plan.architecture, 'run ended before it')}"
                    )
                else:
                    announce(key, f"{plan.tokens(step):,} tokens (step {step}): fine-tuning and probes on {args.task}")
                    info = {"kind": "snapshot", "architecture": plan.architecture, "tokens": plan.tokens(step),
                            "step": step, **evaluation_at(evaluated_in, step)}  # fmt: skip
                    curve.measure(key, str(snapshot), [], info)
            if args.twins:
                key = f"{plan.architecture}-twin"
                first = next((run_dir / "snapshots" / f"step-{s}" for s in plan.steps
                              if (run_dir / "snapshots" / f"step-{s}").is_dir()), run_dir / "final")  # fmt: skip
                if curve.done(key):
                    announce(key, "finished earlier, reused")
                else:
                    announce(key, "from-scratch twin (same architecture, random weights)")
                    curve.measure(
                        key, str(first), ["--from_scratch"], {"kind": "line", "label": f"{plan.architecture} twin"}
                    )
        if args.reference:
            key = "reference"
            if curve.done(key):
                announce(key, "finished earlier, reused")
            else:
                announce(key, f"reference encoder {args.reference}")
                curve.measure(
                    key, args.reference, [], {"kind": "line", "label": f"reference {Path(args.reference).name}"}
                )
    except RuntimeError as error:  # a run failed: finished points and runs stay, the same command continues
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        lock.release()
    summary = summarise(curve.points(), gate_notes)
    title = f"{args.name}: validation {summary['metric']} on {args.task} against pretraining tokens"
    (curve.folder / "curve.md").write_text(format_markdown(summary, args.task, args.name))
    plot(summary, curve.folder / "curve.png", title)
    serialisable = {**summary, "curves": {f"{a} / {m}": s for (a, m), s in summary["curves"].items()},
                    "lines": {f"{label} / {m}": e for (label, m), e in summary["lines"].items()}}  # fmt: skip
    (curve.folder / "curve.json").write_text(json_io.dumps(serialisable, indent=2))
    print((curve.folder / "curve.md").read_text())
    print(f"curve: {curve.folder / 'curve.png'}, table: {curve.folder / 'curve.md'}")
    return 0


if __name__ == "__main__":
    from ..common.entry import run_tool

    sys.exit(run_tool(main, "python -m concept_encoder curve"))
