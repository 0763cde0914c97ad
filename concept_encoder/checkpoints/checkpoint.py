"""Atomic, rotated, verifiable checkpoints through `accelerator.save_state`, and finding one to resume.

A checkpoint is `<run>/checkpoints/step_<N>/`: accelerate's state (model, optimizer, RNG,
registered objects such as the scheduler and the masking collator) plus `train_state.json`
(step, epoch, batches consumed in the epoch), `resume_settings.json` (what a resume must keep:
model shape, processes, batch, data) and, written last, `manifest.json` (every file and its size).
It is written to `step_<N>.tmp` and renamed when complete, so a crash while saving never leaves a
half checkpoint under a valid name and never touches the previous one. A checkpoint whose files do
not match its manifest (missing or truncated) is damaged: `auto` skips it for the newest intact one,
an explicit path to it is refused with the file named.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..common.faults import DiskFullError, is_disk_full, raise_run_folder_gone
from ..common.metrics_log import read_metrics

logger = logging.getLogger("concept_encoder")
TRAIN_STATE = "train_state.json"
MANIFEST = "manifest.json"
RESUME_SETTINGS = "resume_settings.json"


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed: damaged, or written under settings this run cannot continue."""


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of this epoch already consumed (per process)
    tokens_seen: int = 0  # global input tokens
    bad_steps: int = 0  # consecutive non-finite losses
    gates: list = field(default_factory=list)  # decision gates' outcomes so far (`gates.GateMonitor`)
    seconds: float = 0.0  # the run's wall-clock up to this position, over every invocation (a resume adds its own)
    cpu_threads: list = field(default_factory=list)  # torch's CPU threads in each invocation (`record_cpu_threads`)


def record_cpu_threads(state: TrainState, device_type: str) -> int | list:
    """Add this invocation's CPU thread count (`torch.get_num_threads()`) to the run's `state.cpu_threads`, and
    return the run's record: the one count every invocation used, else the counts in the order they came (None for
    the invocations of a checkpoint written before counts were kept). Seeded runs whose math is on the CPU are
    bit-exact only under one count (a sum split over other threads rounds differently), so a resume under another
    count is warned about there: its run will not equal one made under either count alone."""
    import torch

    threads = torch.get_num_threads()
    if state.step and not state.cpu_threads:  # resumed from a checkpoint that kept no count
        state.cpu_threads.append(None)
    known = [count for count in state.cpu_threads if count is not None]
    if known and threads not in known and device_type == "cpu":
        logger.warning("resumed with %d CPU thread(s) where the run ran with %s until step %d: CPU sums round "
                       "differently under another count, so this run will not equal one made under a single count; "
                       "resume with CPU_THREADS=<that count> to keep it exact", threads,
                       "/".join(map(str, known)), state.step)  # fmt: skip
    if threads not in state.cpu_threads:
        state.cpu_threads.append(threads)
    return state.cpu_threads[0] if len(state.cpu_threads) == 1 else list(state.cpu_threads)


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.split("_")[1])


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run (renamed from `.tmp`, with a train state), lowest step first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and (p / TRAIN_STATE).exists()]
    return sorted(done, key=step_of)


def write_manifest(checkpoint: Path) -> None:
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {str(p.relative_to(checkpoint)): p.stat().st_size for p in files}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest, indent=1))


def checkpoint_problems(checkpoint: Path) -> list[str]:
    """What is wrong with a checkpoint's files against its manifest (empty when intact)."""
    manifest_path = checkpoint / MANIFEST
    if not manifest_path.exists():
        return [f"{MANIFEST} is missing (the save did not complete, or the checkpoint predates manifests)"]
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return [f"{MANIFEST} is not valid JSON"]
    if not isinstance(manifest, dict) or not all(isinstance(size, int) for size in manifest.values()):
        return [f"{MANIFEST} is not a list of files and sizes"]
    problems = []
    for name, size in manifest.items():
        path = checkpoint / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} is truncated or changed ({path.stat().st_size} of {size} bytes)")
    if not problems:  # the sizes match: the values must still be what a loop wrote
        problems += [problem for problem in (train_state_problem(checkpoint),) if problem]
        settings = checkpoint / RESUME_SETTINGS
        if settings.is_file() and not isinstance(json_or_none(settings), dict):
            problems.append(f"{RESUME_SETTINGS} does not hold the run's settings (a JSON object)")
    return problems


def json_or_none(path: Path):
    """The JSON value in `path`, or None when it is not readable JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def whole_number(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


TRAIN_STATE_VALUES = {  # what a loop writes in each field of `TrainState` other than the whole numbers
    "gates": lambda value: isinstance(value, list) and all(isinstance(g, dict) and "passed" in g for g in value),
    "seconds": lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf,
    "cpu_threads": lambda value: isinstance(value, list) and all(c is None or whole_number(c) and c > 0 for c in value),
}


def train_state_problem(checkpoint: Path) -> str | None:
    """Why `<checkpoint>/train_state.json` is not a loop position (`TrainState`: whole numbers >= 0, finite seconds
    >= 0, a list of gate outcomes and one of thread counts), else None: checked before anything compares or resumes
    from its values."""
    state = json_or_none(checkpoint / TRAIN_STATE)
    if not isinstance(state, dict):
        return f"{TRAIN_STATE} is not a JSON object"
    fields = TrainState.__dataclass_fields__
    wrong = sorted(key for key, value in state.items()
                   if key not in fields or not TRAIN_STATE_VALUES.get(key, whole_number)(value))  # fmt: skip
    if wrong:
        return f"{TRAIN_STATE} holds values a loop does not write ({', '.join(wrong)})"
    return None


def save_checkpoint(
    accelerator,
    run_dir: Path,
    state: TrainState,
    save_total_limit: int,
    per_rank: dict | None = None,
    resume_settings: dict | None = None,
    shared: dict | None = None,
    keep: frozenset[int] = frozenset(),
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint path. The checkpoints of the steps in `keep`
    (`--checkpoint_steps`) stay; the newest `save_total_limit` of the others are kept.

    `shared` objects (with `state_dict`: the scheduler, the concept-loss weights, the dev selection)
    are the same on every rank and saved once, from the main process, as `<name>.pt`; `per_rank`
    objects differ between ranks, e.g. each rank's masking generator, so each rank writes its own
    `<name>_rank<r>.pt`. Both hold tensors and plain values only, so `load_checkpoint` reads them with
    `weights_only=True` (accelerate's `register_for_checkpointing` would unpickle them in full).
    """
    import torch

    if not Path(run_dir).is_dir():  # saving would silently create a new, empty run folder in its place
        raise_run_folder_gone(Path(run_dir))
    final = Path(run_dir) / "checkpoints" / f"step_{state.step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
        if accelerator.is_main_process:
            for name, obj in (shared or {}).items():
                torch.save(obj.state_dict(), tmp / f"{name}.pt")
        for name, obj in (per_rank or {}).items():
            torch.save(obj.state_dict(), tmp / f"{name}_rank{accelerator.process_index}.pt")
    except (OSError, RuntimeError) as error:  # torch.save reports a full disk as a RuntimeError
        if not is_disk_full(error):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_full(run_dir, f"the checkpoint of step {state.step}") from error
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / TRAIN_STATE).write_text(json.dumps(asdict(state), indent=2))
        (tmp / RESUME_SETTINGS).write_text(json.dumps(resume_settings or {}, indent=2, default=str))
        write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        rotated = [c for c in checkpoint_dirs(run_dir) if step_of(c) not in keep]
        for old in rotated[:-save_total_limit] if save_total_limit > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("checkpoint saved: %s", final)
    accelerator.wait_for_everyone()
    return final


def disk_full(run_dir: Path, what: str) -> DiskFullError:
    """The one-line error for a full disk while saving `what`, naming the run's last intact checkpoint."""
    intact = newest_intact(run_dir)
    return DiskFullError(
        f"no space left on the disk of {run_dir} while saving {what} (the partial files were removed); the last "
        f"intact checkpoint is {intact or 'none (nothing was saved before)'}. Free space, then resume with "
        "--resume_from_checkpoint auto"
    )


def newest_intact(run_dir: Path) -> Path | None:
    """The intact checkpoint with the highest step; damaged ones are reported and skipped."""
    for checkpoint in reversed(checkpoint_dirs(run_dir)):
        problems = checkpoint_problems(checkpoint)
        if not problems:
            return checkpoint
        logger.warning("checkpoint %s is damaged (%s); trying an older one", checkpoint, "; ".join(problems))
    return None


def named_checkpoint_fault(path: Path, alternative: str = "") -> str | None:
    """What is wrong with a checkpoint folder a user named (None: it is intact), to follow its name: "is not a
    checkpoint folder (...); pass a <run>/checkpoints/step_N folder<alternative>" or "is damaged: <the faults>",
    either with the run's newest intact checkpoint when it has one (`resolve_resume`, `export`)."""
    run_dir = path if (path / "checkpoints").is_dir() else path.parent.parent
    intact = newest_intact(run_dir) if (run_dir / "checkpoints").is_dir() else None
    hint = f"; the newest intact checkpoint of that run is {intact}" if intact else ""
    if not (path / TRAIN_STATE).is_file():
        return (
            f"is not a checkpoint folder (no {TRAIN_STATE}); pass a <run>/checkpoints/step_N folder{alternative}{hint}"
        )
    if problems := checkpoint_problems(path):
        return f"is damaged: {'; '.join(problems)}{hint}"
    return None


def resolve_resume(spec: str | None, output_dir: str, run_name: str | None) -> Path | None:
    """`auto` → the newest intact checkpoint of `run_name` (or of the run under `output_dir` that
    saved last); a path → that checkpoint, refused with the damaged file named."""
    if spec is None:
        return None
    if spec != "auto":
        if fault := named_checkpoint_fault(Path(spec), " or `auto`"):
            raise CheckpointError(f"--resume_from_checkpoint {spec} {fault}")
        return Path(spec)
    if run_name:
        runs = [Path(output_dir) / run_name]
    else:  # the run that saved last: folder times choose the run, steps choose within it
        last_saved = {run: dirs[-1] for run in Path(output_dir).glob("*") if (dirs := checkpoint_dirs(run))}
        runs = sorted(last_saved, key=lambda run: last_saved[run].stat().st_mtime, reverse=True)[:1]
    found = newest_intact(runs[0]) if runs else None
    if found is None:
        logger.info("resume=auto: no intact checkpoint under %s, starting fresh", runs[0] if runs else output_dir)
    return found


def sharded_by_deepspeed(checkpoint: Path) -> bool:
    """Whether DeepSpeed wrote `checkpoint` (per-rank `*_states.pt` shards)."""
    return any(Path(checkpoint).rglob("*_states.pt"))


def saved_zero_stage(checkpoint: Path) -> int:
    """The ZeRO stage of a DeepSpeed checkpoint, as its first optimizer shard records it (read `weights_only`,
    memory-mapped); 0 when it holds no shard."""
    import torch

    from .reshard import optimizer_shards

    shards = optimizer_shards(checkpoint)
    if not shards:
        return 0
    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        state = load_state_file(shards[0], mmap=True)
    return int(state.get("optimizer_state_dict", {}).get("zero_stage", 0))


def reshard_problem(checkpoint: Path, saved_world: int) -> str | None:
    """Why a DeepSpeed checkpoint cannot resume on another process count (None: it can, `reshard.staged_checkpoint`)."""
    stage = saved_zero_stage(checkpoint)
    if stage >= 3:
        return (
            f"a ZeRO-3 checkpoint: its weights are partitioned over {saved_world} ranks; resume it with "
            f"{saved_world} processes, or export its weights with `python -m concept_encoder export` and start a "
            "new run from them"
        )
    return None


def saved_world_size(checkpoint: Path) -> int | None:
    settings = json_or_none(Path(checkpoint) / RESUME_SETTINGS)
    return settings.get("world_size") if isinstance(settings, dict) else None


def resharded_position(state: TrainState, saved_world: int | None, world: int) -> TrainState:
    """`state` (micro-batches consumed per process) for `world` processes instead of `saved_world`: the sampler's
    batches are dealt round-robin to the ranks, so the epoch's position in batches is the same count of them."""
    if saved_world and saved_world != world:
        consumed = state.batches_in_epoch * saved_world
        if consumed % world:
            raise CheckpointError(
                f"the checkpoint stopped {consumed} batches into its epoch, which {world} processes cannot share "
                f"evenly; resume with {saved_world} processes"
            )
        state.batches_in_epoch = consumed // world
        logger.info("resumed on %d processes instead of %d: %d batches into the epoch, %d per process", world,
                    saved_world, consumed, state.batches_in_epoch)  # fmt: skip
    return state


def saved_train_state(checkpoint: Path) -> TrainState:
    """The loop position a checkpoint holds (read without loading anything else)."""
    return TrainState(**json.loads((Path(checkpoint) / TRAIN_STATE).read_text()))


def set_aside_later_history(run_dir: Path, step: int) -> Path | None:
    """A run has one history: resuming `run_dir` at `step` moves everything it holds from after `step` (later
    checkpoints and snapshots, the final model, summary, per-rank views, loss curve, and a copy of the full
    metrics.jsonl) into `<run>/abandoned/from-step-<step>-<time>/`, where nothing resumes from it (`auto` looks
    in `checkpoints/` only) and nothing overwrites it. Returns that folder, or None when nothing lies beyond
    `step`. Main process only, before the resumed run writes anything."""
    import datetime as dt

    run_dir = Path(run_dir)
    later = [c for c in checkpoint_dirs(run_dir) if step_of(c) > step]
    snapshots = [p for p in (run_dir / "snapshots").glob("step-*") if p.is_dir() and int(p.name[5:]) > step]
    summary = run_dir / "summary.json"
    finished_later = summary.is_file() and json.loads(summary.read_text()).get("steps", 0) > step
    metrics = run_dir / "metrics.jsonl"
    records_later = metrics.is_file() and any(r.get("step", 0) > step for r in read_metrics(metrics))
    ending = [p for p in (run_dir / "final", summary, run_dir / "ranks", run_dir / "loss_curve.png") if p.exists()]
    if not (later or snapshots or finished_later or records_later or ((run_dir / "final").exists())):
        return None
    folder = run_dir / "abandoned" / f"from-step-{step}-{dt.datetime.now():%Y%m%d-%H%M%S-%f}"
    (folder / "checkpoints").mkdir(parents=True)
    for checkpoint in later:
        shutil.move(str(checkpoint), str(folder / "checkpoints" / checkpoint.name))
    for snapshot in snapshots:
        (folder / "snapshots").mkdir(exist_ok=True)
        shutil.move(str(snapshot), str(folder / "snapshots" / snapshot.name))
    for path in ending:
        shutil.move(str(path), str(folder / path.name))
    if metrics.is_file():
        shutil.copy2(metrics, folder / "metrics.jsonl")  # the live file is cut at `step` by the resumed run
    logger.warning(
        "resuming %s at step %d: its later history (%s) moved to %s; nothing there is resumed or overwritten",
        run_dir, step, ", ".join([*(c.name for c in later), *(s.name for s in snapshots), *(p.name for p in ending)])
        or "metrics after the step", folder,
    )  # fmt: skip
    return folder


def deepspeed_safe_globals() -> list:
    """The classes (beyond tensors and plain values) DeepSpeed's own state files hold: the ZeRO stage enum, its
    loss scalers and ZeRO-1/2's fragment addresses (plain attribute bags). Allowed when those files are checked;
    nothing else is."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address  # ZeRO-1/2 optimizer shards: (numel, start) pairs

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def verify_deepspeed_states(checkpoint: Path, fix: str | None = None) -> None:
    """DeepSpeed reads its `*_model_states.pt` / `*_optim_states.pt` with full unpickling; before it does, each
    is read here with `weights_only=True` (memory-mapped: no second copy of the tensors), allowing only
    `deepspeed_safe_globals()`. A file that needs anything else is refused and nothing from it runs."""
    import torch

    files = sorted(Path(checkpoint).rglob("*_states.pt"))
    if not files:
        return
    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        for path in files:
            load_state_file(path, mmap=True, fix=fix)


RESUME_ANOTHER = "Resume from a checkpoint written by this project"


def load_state_file(path: Path, mmap: bool = False, fix: str | None = None) -> dict:
    """A state file of a checkpoint, read with `weights_only=True`: tensors and plain values only. A file
    that needs anything else (a crafted pickle would run code while loading), or that is damaged (cut short, not a
    torch file), is refused, never run; the line ends with `fix`, what the caller's user can do instead."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"{path} is not a state file this project writes (tensors and plain values only): {first}. It was not "
            f"loaded: nothing from it ran. {fix or RESUME_ANOTHER}"
        ) from None


def checked_state(path: Path, obj) -> dict:
    """`path`'s state for `obj`, refused when it lacks a key `obj` itself has (the resume would not be exact)."""
    state = load_state_file(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict; the checkpoint is damaged")
    missing = sorted(set(obj.state_dict()) - set(state))
    if missing:
        raise CheckpointError(
            f"{path} lacks {missing}: resuming without them would not continue the run exactly; "
            "resume from another checkpoint of the run"
        )
    return state


def load_checkpoint(
    accelerator, checkpoint: Path, per_rank: dict | None = None, shared: dict | None = None, run_dir: Path | None = None
) -> TrainState:
    """Restore accelerate's state, the `shared` objects, this rank's `per_rank` objects, and the loop position.
    Every state file of ours is read (weights_only) and checked before anything is restored. A DeepSpeed
    checkpoint of another process count is loaded from its universal conversion, staged in `run_dir`
    (`reshard.staged_checkpoint`; the engine was built with `reshard.plan_universal_load`)."""
    from .reshard import needs_universal_load, staged_checkpoint

    saved_world = saved_world_size(checkpoint)
    new_rank = saved_world is not None and accelerator.process_index >= saved_world  # a run grown to more processes
    rng = checkpoint / f"random_states_{accelerator.process_index}.pkl"
    if not rng.exists() and not new_rank:
        raise CheckpointError(f"{rng} is missing: without it the data order and dropout would not resume exactly")
    states = []
    for index, (name, obj) in enumerate((shared or {}).items()):
        path = checkpoint / f"{name}.pt"
        legacy = checkpoint / f"custom_checkpoint_{index}.pkl"  # written by register_for_checkpointing before
        states.append((obj, checked_state(path if path.exists() or not legacy.exists() else legacy, obj)))
    for name, obj in (per_rank or {}).items():
        path = checkpoint / f"{name}_rank{accelerator.process_index}.pt"
        if new_rank:  # no rank of the checkpoint had this one's stream: it starts as built (seeded by its rank)
            logger.info("rank %d is new to this run: its %s starts from its own seed", accelerator.process_index, name)
            continue
        if not path.exists():
            raise CheckpointError(
                f"{path} is missing: the checkpoint was written by fewer processes than this run has; "
                f"resume with the same number of processes"
            )
        states.append((obj, checked_state(path, obj)))
    verify_deepspeed_states(checkpoint)  # before DeepSpeed unpickles them in full
    universal = needs_universal_load(checkpoint, saved_world, accelerator.num_processes)
    if universal and run_dir is None:
        raise CheckpointError(f"{checkpoint} was saved by {saved_world} processes: resharding it needs a run folder")
    with staged_checkpoint(accelerator, checkpoint, run_dir, universal) as folder:
        accelerator.load_state(str(folder))
    for obj, state in states:
        obj.load_state_dict(state)
    return resharded_position(saved_train_state(checkpoint), saved_world, accelerator.num_processes)
