"""Fine-tuning and linear probes on a labelled task, several seeds, beside strong simple baselines:
is a pretrained model any good?

    accelerate launch loops/finetune.py --model_name_or_path Cache/runs/<run>/final --task embedded
    accelerate launch loops/finetune.py --model_name_or_path Cache/runs/<run>/final --from_scratch --probe
    accelerate launch loops/finetune.py --model_name_or_path path/to/bert --task glue:rte --seeds 5

`main()` runs steps 1-6 of the project's init order once (process, logging, arguments, checks, task and its
baselines), then for every model: the linear probe (`--probe`, frozen features) and the fine-tuning runs,
each of which is steps 7-12 in `fine_tune()` (model, kernel probe, compile, run dir, config + W&B, train with
the step chosen on the dev split). Every choice is made on the dev split, carved from the training split
with a fixed seed: the learning rate (each rate of `--learning_rates` tried on the first seed, the best
used for all seeds), the step, the probe's and the TF-IDF baseline's regularisation. Step 13, the
validation split, is evaluated once per seed, after every choice (`validate()`, from the saved model).
Finally the report (`Cache/reports/finetune_<time>.{md,json,png}`). Decision gates (`--gate
"accuracy>=0.3@100"`, on the task's dev metrics) stop a run that fails one (its best step so far is still
evaluated and saved); the invocation then exits with code 3 (`concept_encoder.training.gates`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import inspect
import json
import logging
import math
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the project root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from concept_encoder.common import json_io
from concept_encoder.common.entry import interrupt_in_one_line, run_tool

if __name__ == "__main__":  # Ctrl-C while the rest imports (transformers, torch: seconds): one line
    interrupt_in_one_line("loops/finetune.py")

from concept_encoder.common.padding import padded_length
from concept_encoder.training.preflight import fail_fast, one_line_errors, preflight

if __name__ == "__main__":  # a bad argument fails in about a second, before torch and the models load
    from concept_encoder.training.args import FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS

    fail_fast(sys.argv[1:], FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS)

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, broadcast_object_list, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

import concept_encoder  # noqa: F401 (registers the Concept Encoder with the Auto classes)
from concept_encoder.checkpoints.checkpoint import (
    CheckpointError,
    TrainState,
    disk_full,
    load_checkpoint,
    record_cpu_threads,
    resolve_resume,
    save_checkpoint,
)
from concept_encoder.checkpoints.model_folder import (
    check_model_folder,
    holds_only_saved_model_files,
    model_digest,
    save_model_weights,
    save_tokenizer_without_code,
)
from concept_encoder.common.accelerator_state import plain_model
from concept_encoder.common.faults import NonFiniteLossError, is_disk_full
from concept_encoder.common.metrics_log import MetricsWriter, read_metrics
from concept_encoder.common.paths import folder_problem, written_aside
from concept_encoder.data.tokenizer import check_vocab_covers, model_tokenizer_folder, slug
from concept_encoder.finetuning.chunked import apply_reading, chunk_problem
from concept_encoder.finetuning.probe import describe_pooling, linear_probe
from concept_encoder.finetuning.report import write_report
from concept_encoder.finetuning.selection import BestStep
from concept_encoder.tasks.baselines import split_rows, task_baselines, task_digest
from concept_encoder.tasks.leakage import pretraining_overlap
from concept_encoder.tasks.loading import encode_splits, load_task
from concept_encoder.tasks.metrics import (
    accuracy_by_group,
    accuracy_by_position,
    compute_metrics,
    metric_sign,
    predictions_from_logits,
)
from concept_encoder.training.args import FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS, PER_SEED, parse_args, seed_model
from concept_encoder.training.attention_probe import compute_dtype, probe_attention_kernels
from concept_encoder.training.batches import LengthBucketedBatches, accumulation_windows, unpadded_or_marked
from concept_encoder.training.deepspeed_setup import adamw_class, fill_deepspeed_auto_values, launched_zero_stage
from concept_encoder.training.evaluation import predict
from concept_encoder.training.gates import GATE_ACTION_TEXT, GATE_EXIT_CODE, GateMonitor, describe_outcome, parse_gates
from concept_encoder.training.logs import log_model_info, log_system_info, setup_logging
from concept_encoder.training.model import build_classifier, check_pooling
from concept_encoder.training.optim import build_optimizer, build_scheduler, count_skipped_step
from concept_encoder.training.resume import argument_settings, check_resume_settings, settings_differences
from concept_encoder.training.runs import init_wandb, save_run_config, setup_run_dirs
from concept_encoder.training.runtime import (
    finish_distributed,
    maybe_compile,
    model_state_dict,
    set_tf32,
    setup_distributed,
)
from concept_encoder.training.steps import finetuning_step as train_step  # the loop's step (tests patch it here)
from concept_encoder.training.tracking import (
    PreemptionFlag,
    StoppedBySignal,
    any_rank,
    memory_stats,
    peak_memory_over_ranks,
)

logger = logging.getLogger("concept_encoder")


def model_tag(path: str, from_scratch: bool) -> str:
    """A short name for a model folder in run names and the report (`<run>/final` → `<run>`,
    `<run>/snapshots/step-N` → `<run>-step-N`; `{seed}`, one model per seed, → `S`)."""
    folder = Path(path.replace(PER_SEED, "S"))
    name = folder.parent.name if folder.name == "final" else folder.name
    if folder.parent.name == "snapshots":
        name = f"{folder.parent.parent.name}-{folder.name}"
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip("-.") or "model"  # part of run folder names
    return f"{name}{'-scratch' if from_scratch else ''}"


# How a run orders its training split, in its settings: runs trained in the file's order (182148a to d6798c1, every
# seed alike) record no order and are never reused or resumed as runs of this one
TRAIN_ORDER = "shuffled per seed"


def make_loaders(splits, tokenizer, model, args, seed: int, *, shuffle_train: bool = True,
                 bucket_by_length: bool = False, pad_to_multiple_of: int | None = None) -> dict[str, DataLoader]:  # fmt: skip
    """split → DataLoader, padded per batch (its length rounded up to `pad_to_multiple_of`), with only the keys
    `model.forward` accepts (the row `id` stays out); the training split shuffled in an order drawn from `seed`
    (`shuffle_train`), and with `bucket_by_length` in batches of examples of similar length
    (`LengthBucketedBatches`). The options are keyword-only: passed by position, `bucket_by_length` once landed on
    `shuffle_train`, and every fine-tuning run trained on its split in file order, the same for every seed."""
    accepted = set(inspect.signature(model.forward).parameters)
    pad = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of)

    def collate(examples):
        return {k: v for k, v in unpadded_or_marked(pad(examples)).items() if k in accepted}

    loaders = {}
    # --dataloader_workers collate in worker processes (the sampler stays here, so order and resume are unchanged);
    # pinned: accelerate copies each batch to the GPU as it is (with non_blocking=True, `fine_tune`'s Accelerator)
    workers = {"num_workers": args.dataloader_num_workers, "pin_memory": torch.cuda.is_available()}
    for name, split in splits.items():
        if name == "train" and shuffle_train and bucket_by_length:
            lengths = [len(ids) for ids in split["input_ids"]]
            batches = LengthBucketedBatches(lengths, args.per_device_train_batch_size, seed)
            # its own generator: a DataLoader draws each iterator's base seed from it, else from the global RNG,
            # which a resumed run would then draw once more than the run it continues (dropout would differ)
            loaders[name] = DataLoader(split, batch_sampler=batches, collate_fn=collate, **workers,
                                       generator=torch.Generator().manual_seed(seed))  # fmt: skip
            continue
        size = args.per_device_train_batch_size if name == "train" else args.per_device_eval_batch_size
        loaders[name] = DataLoader(split, batch_size=size, shuffle=shuffle_train and name == "train", **workers,
                                   collate_fn=collate, generator=torch.Generator().manual_seed(seed))  # fmt: skip
    return loaders


def fine_tune(
    state, model_path: str, seed: int, rate: float, task, splits, tokenizer, fargs, task_args, args, run_base: str
):
    """Steps 7-12 for one model, seed and learning rate; returns the run's result (the step chosen on dev, its
    dev metrics, the training loss at the start and end); raises `StoppedBySignal` when a signal stopped it (after
    a checkpoint). The chosen step's weights are saved to `<run>/final`; the validation split is not touched."""
    started = time.perf_counter()
    tag = model_tag(model_path, fargs.from_scratch)
    model_path = seed_model(model_path, seed)  # this seed's own model where the path names one per seed
    run_args = dataclasses.replace(
        args, run_name=f"{run_base}-{tag}-lr{rate:g}-seed{seed}", seed=seed, learning_rate=rate
    )
    # what decides this run's result: a finished run or a checkpoint is reused only under the same settings
    settings = {"model": model_path, "model_sha256": model_digest(model_path, weights=not fargs.from_scratch),
                "from_scratch": fargs.from_scratch, "extend_positions": fargs.extend_positions,
                "chunk_length": fargs.chunk_length, "bucket_by_length": fargs.bucket_by_length,
                "pad_to_multiple_of": fargs.pad_to_multiple_of, "train_order": TRAIN_ORDER, "task": task.name,
                "task_sha256": task_digest(task), "seed": seed, "learning_rate": rate, "pooling": fargs.pooling,
                "max_steps": args.max_steps, "world_size": state.num_processes,
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "torch_compile": args.torch_compile, "schedule": run_args.schedule,
                **argument_settings(run_args, task_args)}  # fmt: skip
    finished = Path(args.output_dir) / run_args.run_name / "summary.json"
    if args.resume_from_checkpoint and finished.exists():  # resuming an invocation: this run is done
        done = json.loads(finished.read_text())
        if "settings" not in done:
            logger.warning("%s finished before and recorded no settings: reusing it unchecked", finished.parent)
        elif differences := settings_differences(done["settings"], settings, "finished run"):
            raise CheckpointError(
                f"{finished.parent} finished before under other settings ({'; '.join(differences)}): its result is "
                "not this run's. Choose another --run_name, or run again without --resume_from_checkpoint"
            )
        logger.info("%s finished before: reusing its result", finished.parent)
        return done
    resume = resolve_resume(args.resume_from_checkpoint, args.output_dir, run_args.run_name)
    if torch.cuda.is_available():  # this run's peak, not an earlier seed's
        torch.cuda.reset_peak_memory_stats()
    set_seed(seed)
    # 7. model: the checkpoint's encoder with a fresh task head (or fresh weights with --from_scratch)
    model, note = classifier(model_path, task, fargs, task_args)
    logger.info("model %s (seed %d, lr %g): %s", model_path, seed, rate, note)
    counts = log_model_info(model, {"task": task.name, "seed": seed, "learning_rate": rate})
    loaders = make_loaders({k: splits[k] for k in ("train", "dev")}, tokenizer, model, args, seed,
                           bucket_by_length=fargs.bucket_by_length,
                           pad_to_multiple_of=fargs.pad_to_multiple_of)  # not validation  # fmt: skip
    # 8. attention-kernel probe (main process, attention calls of the model's shape)
    probe_attention_kernels(model.config, next(iter(loaders["dev"])), state, compute_dtype(args.mixed_precision),
                            decoder=False)  # fmt: skip
    tf32 = set_tf32(args.tf32, state)
    pooling = describe_pooling(model, fargs.chunk_length, fargs.pooling)
    # 9. optional torch.compile
    model = maybe_compile(model, args.torch_compile)
    # 10. run dir: one per model, seed and rate; a resume must continue the same settings
    if resume is not None:
        check_resume_settings(resume, settings)
    run_dir, run_lock = setup_run_dirs(run_args, "finetune", counts["total"], state)
    preemption = PreemptionFlag()  # from here on a signal ends the run with a checkpoint
    try:
        # 11. resolved config saved + logged; W&B
        config = {"finetune_args": dataclasses.asdict(fargs), "task": {"name": task.name, "type": task.task_type,
                  "num_labels": task.num_labels, "sizes": task.sizes(), "metrics": task.metric_names},
                  "training_args": dataclasses.asdict(run_args), "model": model_path, "note": note,
                  "pooling": pooling, "parameters": counts, "tf32": tf32}  # fmt: skip
        if state.is_main_process:
            save_run_config(run_dir, config)
        wandb_run = init_wandb(run_args, run_dir, config, state)
        # 12. Accelerator, prepare, train (checkpoints, preemption, exact resume); select the step on dev
        accelerator = Accelerator(
            mixed_precision=args.mixed_precision,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            # non_blocking: the pinned batches (`make_loaders`) are copied to the GPU without a host sync
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed, non_blocking=True),
        )
        fill_deepspeed_auto_values(accelerator, run_args)
        optimizer = build_optimizer(model, run_args, adamw=adamw_class(accelerator))
        scheduler = build_scheduler(optimizer, run_args)
        model, optimizer, train_loader, dev_loader = accelerator.prepare(
            model, optimizer, loaders["train"], loaders["dev"]
        )
        main_metric = task.metric_names[0]
        best = BestStep(main_metric, sign=metric_sign(main_metric))
        shared = {"scheduler": scheduler, "selection": best}  # checkpointed, read back with weights_only=True
        progress = TrainState()
        gates = GateMonitor(args.gates)  # on the dev metrics, at every dev evaluation
        if resume is not None:
            progress = load_checkpoint(accelerator, resume, shared=shared)
            started -= progress.seconds  # the run's wall-clock counts its earlier invocations too
            gates.load_state_dict({"outcomes": progress.gates})
            logger.info("resumed from %s at step %d", resume, progress.step)
        threads = record_cpu_threads(progress, accelerator.device.type)  # CPU sums depend on the count: in checkpoints
        metrics = MetricsWriter(run_dir / "metrics.jsonl", wandb_run) if accelerator.is_main_process else None
        if metrics:
            metrics.drop_after(progress.step)
        source = accumulation_windows(train_loader, args.gradient_accumulation_steps, progress, lambda batch: batch)
        bar = tqdm(total=args.max_steps, initial=progress.step, desc=f"{tag} lr {rate:g} seed {seed}",
                   disable=not (accelerator.is_main_process and args.progress_bar))  # fmt: skip
        preempted = False
        gate_stopped = bool(gates.failed()) and args.gate_action == "stop"  # a resumed run a gate had stopped
        reached = best.reached(fargs.stop_at_dev)  # a resumed run that had reached --stop_at_dev
        last_evaluated = best.step
        model.train()
        while progress.step < args.max_steps and not (gate_stopped or reached):
            stepped = train_step(accelerator, model, optimizer, next(source), args.max_grad_norm)
            if stepped["applied"]:
                scheduler.step()
            count_skipped_step(progress, stepped["applied"], f"fine-tuning {stepped['what']}", args.max_bad_steps,
                               "lower --learning_rates, use bf16 instead of fp16, or check the task's labels and the "
                               "model")  # fmt: skip
            loss = stepped["loss"]
            progress.step += 1
            step = progress.step
            bar.update(1)
            if step % args.logging_steps == 0:
                memory = peak_memory_over_ranks(accelerator)  # every rank: a gather; host memory over the run
                if metrics:
                    metrics.write({"kind": "train", "step": step, "loss": loss, "lr": scheduler.get_last_lr()[0],
                                   **memory})  # fmt: skip
            if step % (args.eval_steps or args.max_steps) == 0 or step == args.max_steps:
                logits, labels = predict(accelerator, model, dev_loader)
                dev = compute_metrics(task.metric_names, predictions_from_logits(task.task_type, logits), labels)
                if metrics:
                    metrics.write({"kind": "dev", "step": step, **dev})
                best.offer(step, dev, lambda: model_state_dict(accelerator, model))
                last_evaluated = step
                if reached := best.reached(fargs.stop_at_dev):
                    logger.info("%s lr %g seed %d: dev %s %g reached --stop_at_dev %g at step %d: stopped", tag, rate,
                                seed, main_metric, dev[main_metric], fargs.stop_at_dev, step)  # fmt: skip
                for failure in gates.check(step, dev):
                    logger.warning("seed %d: gate failed: %s; %s", seed, describe_outcome(failure),
                                   GATE_ACTION_TEXT[args.gate_action])  # fmt: skip
                    gate_stopped = args.gate_action == "stop"
                progress.gates = gates.summary()
            [preempted] = any_rank(accelerator, preemption.raised)
            if preempted or gate_stopped or reached or (args.save_steps and step % args.save_steps == 0):
                progress.seconds = round(time.perf_counter() - started, 1)
                save_checkpoint(accelerator, run_dir, progress, args.save_total_limit, None, settings, shared)
            if preempted:
                logger.warning("stopped by signal at step %d; resume with --resume_from_checkpoint auto", step)
                break
        bar.close()
        if preempted:
            accelerator.wait_for_everyone()
            raise StoppedBySignal(preemption.exit_code)
        still_improving = best.step == last_evaluated and not (gate_stopped or reached)
        if still_improving:
            logger.warning("%s lr %g seed %d: the chosen step %d is the last one evaluated: still improving: train "
                           "longer (--max_steps or --epochs)", tag, rate, seed, best.step)  # fmt: skip
        result = {"model": tag, "method": "fine-tune", "task": task.name, "seed": seed, "learning_rate": rate,
                  "pooling": pooling, "parameters": counts["total"], "best_step": best.step, "steps": progress.step,
                  "still_improving": still_improving, "dev": best.dev, "memory": memory_stats(accelerator.device),
                  "seconds": round(time.perf_counter() - started, 1), "run_dir": str(run_dir), "settings": settings,
                  "cpu_threads": threads,  # one count, or each invocation's where a resume changed it
                  **({"gates": gates.summary(), "stopped_by_gate": gate_stopped} if args.gate else {}),
                  **({"stopped_at_dev": reached} if fargs.stop_at_dev is not None else {})}  # fmt: skip
        last = model_state_dict(accelerator, model) if fargs.report_last_step else None  # collective
        if accelerator.is_main_process:
            losses = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"
                      and r["loss"] is not None]  # fmt: skip
            ends = max(1, len(losses) // 10)  # mean of the first and the last tenth of the logged losses
            result["train_loss"] = [sum(losses[:ends]) / ends, sum(losses[-ends:]) / ends] if losses else None
            final = run_dir / "final"  # written aside: never half a model; replaces only a model folder ours
            try:
                with written_aside(final, replace_existing=True, legacy=holds_only_saved_model_files) as partial:
                    save_model_weights(plain_model(accelerator, model), partial, best.weights, args.save_dtype)
                    save_tokenizer_without_code(tokenizer, partial)
                if fargs.report_last_step:  # the weights the run ended with, beside the dev-chosen step's
                    with written_aside(run_dir / "last", replace_existing=True) as partial:
                        save_model_weights(plain_model(accelerator, model), partial, last, args.save_dtype)
                        save_tokenizer_without_code(tokenizer, partial)
                with written_aside(run_dir / "summary.json") as partial:  # a seed is finished when this is whole
                    partial.write_text(json_io.dumps(result, indent=2))
            except (OSError, RuntimeError) as error:  # a full disk: one line naming the last intact checkpoint
                if is_disk_full(error):
                    raise disk_full(run_dir, f"the model {final}") from error
                raise
            logger.info("%s lr %g seed %d: step %d chosen on dev (%s %.4f)", tag, rate, seed, best.step, main_metric,
                        best.dev[main_metric])  # fmt: skip
            if wandb_run is not None:
                wandb_run.summary.update({f"dev/{k}": v for k, v in best.dev.items()})
                wandb_run.summary.update({k: result[k] for k in ("gates", "stopped_by_gate") if k in result})
                wandb_run.finish()
        accelerator.wait_for_everyone()
        accelerator.free_memory()
        return result
    finally:
        preemption.restore()
        if run_lock is not None:
            run_lock.release()


def validate(state, result: dict, task, splits, tokenizer, fargs, args) -> dict:
    """Step 13: the validation split, evaluated once for a run whose every choice is made: the saved model of
    `result["run_dir"]` (the step chosen on dev) predicts it; the metrics join `result` and its summary.json."""
    run_dir = Path(result["run_dir"])
    if "validation" in result:  # a finished run of an earlier invocation
        return result
    state.wait_for_everyone()  # the main process saved final/
    accelerator = Accelerator()  # only to shard the loader and gather: the model is not wrapped (no DeepSpeed engine)
    validation, predictions, labels = predict_saved(accelerator, run_dir / "final", task, splits, tokenizer, fargs,
                                                    args, result["seed"])  # fmt: skip
    result = {**json.loads((run_dir / "summary.json").read_text()), "validation": validation,
              "rows": {name: split_rows(split) for name, split in splits.items()}}  # fmt: skip
    if task.validation_positions is not None:  # the loader keeps the split's order (no shuffle; gathered in order)
        result["validation_by_position"] = accuracy_by_position(predictions, labels, task.validation_positions)
    if groups := task.validation_groups():  # accuracy by e.g. ListOps' depth and length, in the split's order
        result["validation_by"] = {name: accuracy_by_group(predictions, labels, of) for name, of in groups.items()}
    if fargs.report_last_step:
        result["validation_last_step"] = predict_saved(accelerator, run_dir / "last", task, splits, tokenizer,
                                                       fargs, args, result["seed"])[0]  # fmt: skip
    if accelerator.is_main_process:
        MetricsWriter(run_dir / "metrics.jsonl").write(
            {"kind": "validation", "step": result["best_step"], **validation}
        )
        (run_dir / "summary.json").write_text(json_io.dumps(result, indent=2))
        logger.info("%s lr %g seed %d: validation %s", result["model"], result["learning_rate"], result["seed"],
                    validation)  # fmt: skip
    if accelerator.num_processes > 1:  # each rank's view: with gathered predictions they must agree
        (run_dir / "ranks").mkdir(exist_ok=True)
        view = {"best_step": result["best_step"], "dev": result["dev"], "validation": validation}
        (run_dir / "ranks" / f"rank{accelerator.process_index}.json").write_text(json_io.dumps(view))
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    return result


def predict_saved(accelerator, folder: Path, task, splits, tokenizer, fargs, args, seed: int):
    """The saved classifier in `folder` on the validation split: (metrics, predictions, labels), in its order."""
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    apply_reading(model, fargs.chunk_length, fargs.pooling)  # a reading mode, not weights: applied again
    loader = make_loaders({"validation": splits["validation"]}, tokenizer, model, args, seed,
                          pad_to_multiple_of=fargs.pad_to_multiple_of)["validation"]  # fmt: skip
    model, loader = model.to(accelerator.device), accelerator.prepare_data_loader(loader)
    logits, labels = predict(accelerator, model, loader)
    predictions = predictions_from_logits(task.task_type, logits)
    return compute_metrics(task.metric_names, predictions, labels), predictions, labels


def classifier(model_path: str, task, fargs, task_args):
    """`build_classifier` for `model_path` as the arguments ask: position tables grown to the task's
    --max_seq_length under `--extend_positions copy` (a fresh one under `--from_scratch` to the longest batch
    `--pad_to_multiple_of` pads), inputs read in chunks under `--chunk_length`."""
    extend_to = task_args.max_seq_length if fargs.extend_positions == "copy" else None
    if fargs.from_scratch and fargs.pad_to_multiple_of:  # a fresh table covers the longest padded batch
        extend_to = max(extend_to or 0, padded_length(task_args.max_seq_length, fargs.pad_to_multiple_of))
    model, note = build_classifier(model_path, task, fargs.from_scratch, fargs.pooling, extend_to)
    if reading := apply_reading(model, fargs.chunk_length, fargs.pooling):
        note += f"; {reading}"
    return model, note


def fine_tune_model(state, model_path: str, task, splits, tokenizer, fargs, task_args, args, run_base: str):
    """Every learning rate of the grid on the first seed, the rate with the best dev metric for every seed,
    then each seed's chosen run evaluated once on validation. Returns the runs (one per seed, each with the
    grid's dev scores and the chosen rate); `StoppedBySignal` when a signal stopped a run."""
    main_metric = task.metric_names[0]
    sign = metric_sign(main_metric)
    seeds = list(range(args.seed, args.seed + fargs.seeds))
    tried = {}
    for rate in fargs.rates:
        tried[rate] = fine_tune(
            state, model_path, seeds[0], rate, task, splits, tokenizer, fargs, task_args, args, run_base
        )
    chosen = max(fargs.rates, key=lambda rate: sign * tried[rate]["dev"][main_metric])  # ties: the first rate
    grid = {f"{rate:g}": tried[rate]["dev"][main_metric] for rate in fargs.rates}
    if len(grid) > 1:
        logger.info("%s: learning rate %g chosen on dev (%s by rate: %s)", model_tag(model_path, fargs.from_scratch),
                    chosen, main_metric, grid)  # fmt: skip
    runs = [tried[chosen]]
    for seed in seeds[1:]:
        runs.append(
            fine_tune(state, model_path, seed, chosen, task, splits, tokenizer, fargs, task_args, args, run_base)
        )
    grid_seconds = {f"{rate:g}": tried[rate]["seconds"] for rate in fargs.rates if rate != chosen}  # the grid's cost
    return [{**validate(state, run, task, splits, tokenizer, fargs, args), "rate_grid": grid,
             "rate_grid_seconds": grid_seconds} for run in runs]  # fmt: skip


def probe_model(state, model_path: str, task, splits, tokenizer, fargs, task_args, args) -> list[dict]:
    """Linear probes on the frozen features of `model_path` (main process; the others wait): one run for
    pretrained weights (the features are deterministic), one per seed for `--from_scratch` (random weights) and for a
    model per seed (`{seed}` in its path)."""
    results = []
    if state.is_main_process:
        seeds = range(args.seed, args.seed + (fargs.seeds if fargs.from_scratch or PER_SEED in model_path else 1))
        for seed in seeds:
            started = time.perf_counter()
            set_seed(seed)
            model, _ = classifier(seed_model(model_path, seed), task, fargs, task_args)
            model.to(state.device)
            loaders = make_loaders(
                splits, tokenizer, model, args, seed, shuffle_train=False, pad_to_multiple_of=fargs.pad_to_multiple_of
            )
            for features, fit in linear_probe(model, loaders, splits, task, state.device).items():
                results.append({"model": model_tag(model_path, fargs.from_scratch), "method": f"probe: {features}",
                                "task": task.name, "seed": seed, "pooling": features, "dev": fit["dev"],
                                "validation": fit["validation"], "probe_grid": fit["grid"], "probe_C": fit["chosen"],
                                **{k: fit[k] for k in ("validation_by_position",) if k in fit},
                                "rows": {name: split_rows(split) for name, split in splits.items()},
                                "seconds": round(time.perf_counter() - started, 1)})  # fmt: skip
                logger.info("probe of %s (%s, seed %d): C=%g chosen on dev; validation %s", model_path, features, seed,
                            fit["chosen"], fit["validation"])  # fmt: skip
    state.wait_for_everyone()
    return results


def main(argv: list[str] | None = None) -> int:
    # 1. distributed setup
    state = setup_distributed()
    # 2. logging
    setup_logging(state, name="finetune")
    # 3. arguments: the model and seeds, the task, the shared optimisation/run settings
    fargs, task_args, args = parse_args(argv, classes=FINETUNE_ARGUMENT_CLASSES, defaults=FINETUNE_DEFAULTS)
    # 4. preflight (every model folder: one per seed where a path holds {seed}; output folder, precision), seed, system
    # info
    for each in fargs.per_folder(args.seed):
        preflight(each, task_args, args, cuda=state.device.type == "cuda")
    seed_folders = {path: fargs.seed_folders(path, args.seed) for path in fargs.models}
    every_folder = [folder for folders in seed_folders.values() for folder in folders]
    if launched_zero_stage() == 3:  # checked before any run folder is written
        raise ValueError(
            "fine-tuning keeps the weights of the step chosen on dev, which ZeRO-3 partitions across ranks; "
            "use a ZeRO-0/1/2 config (ds_configs/zero2.json), or plain DDP: classifiers of these sizes fit"
        )
    if args.resume_from_checkpoint not in (None, "auto") or args.resume_from_checkpoint and not args.run_name:
        raise ValueError(
            "fine-tuning resumes with --resume_from_checkpoint auto and the --run_name of the interrupted "
            "invocation (finished seeds are reused, the interrupted one continues from its checkpoint)"
        )
    if problem := folder_problem(fargs.report_dir, "--report_dir"):  # where the result goes, before the work
        raise ValueError(problem)
    tags: dict[str, str] = {}  # run names and report rows are named by each model's tag: one model per tag
    folders: dict[Path, str] = {}  # and each folder once, however it is spelled (a link, a trailing slash)
    for path in fargs.models:
        if (folder := Path(path).resolve()) in folders:
            raise ValueError(f"{path} is given twice (as {folders[folder]}: the same folder); name each model once")
        if (tag := model_tag(path, fargs.from_scratch)) in tags:
            raise ValueError(
                f"models {tags[tag]} and {path} would share the name {tag!r} (their run folders and report rows): "
                "fine-tune one of them in another invocation with its own --run_name, or copy it to a folder of "
                "another name"
            )
        tags[tag], folders[folder] = path, path
    for path in every_folder:  # each folder what it claims, --pooling one its head has, a tokenizer: before training
        check_model_folder(path, weights=not fargs.from_scratch)
        config = AutoConfig.from_pretrained(path)
        check_pooling(config, fargs.pooling, path)
        if fargs.chunk_length and (problem := chunk_problem(config, fargs.chunk_length)):
            raise ValueError(f"{path}: {problem}")
        model_tokenizer_folder(path, fargs.tokenizer)
    set_seed(args.seed)
    log_system_info(state)
    # 5-6. the task's splits (train, dev carved with a fixed seed, validation), sizes logged; its baselines
    task = load_task(task_args)
    for path in [] if fargs.from_scratch else every_folder:  # pretrained on task text held out here: refused
        if problem := pretraining_overlap(path, AutoConfig.from_pretrained(path), task):
            raise ValueError(problem)
    parse_gates(args.gate, task.metric_names, f"task {task.name}'s dev split")  # the task's own metrics
    logger.info("task %s (%s, %d labels): %s", task.name, task.task_type, task.num_labels, task.sizes())
    if fargs.epochs is not None:  # the length in passes over the training split, as optimizer steps
        per_step = args.per_device_train_batch_size * state.num_processes * args.gradient_accumulation_steps
        args = dataclasses.replace(args, max_steps=max(1, math.ceil(fargs.epochs * len(task.train) / per_step)))
        logger.info("--epochs %g: %d optimizer steps of %d examples", fargs.epochs, args.max_steps, per_step)
    baselines = task_baselines(task, cache_dir=Path(args.output_dir).parent)  # Cache/baselines by default
    baselines["task_sha256"] = task_digest(task)  # merged reports pool only runs of one task content
    logger.info("baselines on validation: majority %s; %s (%s=%g chosen on dev) %s", baselines["majority"],
                baselines["tfidf"]["name"], baselines["tfidf"]["parameter"], baselines["tfidf"]["chosen"],
                baselines["tfidf"]["validation"])  # fmt: skip
    stamp = [f"{dt.datetime.now():%Y%m%d-%H%M%S}"]
    if state.num_processes > 1:
        broadcast_object_list(stamp, from_process=0)  # one name for the run folders on every rank
    run_base = args.run_name or f"ft-{slug(task.name)}-{stamp[0]}"  # recall:4 → recall_4: a folder name
    results = []
    for model_path in fargs.models:
        first = seed_folders[model_path][0]  # a model per seed: one tokenizer, every seed's vocabulary covered
        tokenizer = AutoTokenizer.from_pretrained(model_tokenizer_folder(first, fargs.tokenizer))
        for folder in seed_folders[model_path]:
            check_vocab_covers(tokenizer, AutoConfig.from_pretrained(folder).vocab_size)
        splits = encode_splits(task, tokenizer, task_args.max_seq_length)
        if fargs.probe:
            results += probe_model(state, model_path, task, splits, tokenizer, fargs, task_args, args)
        if fargs.finetune:
            try:
                results += fine_tune_model(state, model_path, task, splits, tokenizer, fargs, task_args, args,
                                           run_base)  # fmt: skip
            except StoppedBySignal as stop:  # checkpointed: no report from a partial set of runs
                finish_distributed(state)  # every rank stopped here (the signal is agreed on by all)
                return stop.exit_code
    # report: one row per (model, method, task), mean ± std over seeds, beside the baselines
    if state.is_main_process:
        parts = [f"fine-tuning ({args.max_steps} steps, learning rate from {fargs.learning_rates})"] * fargs.finetune
        parts += ["linear probes on frozen features"] * fargs.probe
        title = f"`{task.name}`, {fargs.seeds} seed(s): {' and '.join(parts)}; every choice made on the dev split"
        paths = write_report(results, {task.name: baselines}, Path(fargs.report_dir), title)
        logger.info("report: %s", ", ".join(str(p) for p in paths.values()))
        print(paths["md"].read_text())
    finish_distributed(state)  # every rank met, the process group destroyed before the interpreter ends
    stopped = [r for r in results if r.get("stopped_by_gate")]
    if stopped:
        logger.warning("%d run(s) stopped by a gate: %s", len(stopped), ", ".join(r["run_dir"] for r in stopped))
        return GATE_EXIT_CODE
    return 0


if __name__ == "__main__":
    with one_line_errors(NonFiniteLossError):
        sys.exit(run_tool(main, "loops/finetune.py"))
