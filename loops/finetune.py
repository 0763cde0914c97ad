"""Fine-tuning on a labelled task, several seeds, beside the trivial baseline: is a pretrained model any good?

    accelerate launch loops/finetune.py --model_name_or_path Cache/runs/<run>/final --task embedded
    accelerate launch loops/finetune.py --model_name_or_path Cache/runs/<run>/final --from_scratch
    accelerate launch loops/finetune.py --model_name_or_path path/to/bert --task glue:rte --seeds 5

`main()` runs steps 1-6 of the project's init order once (process, logging, arguments, checks, task),
then steps 7-13 for every model and seed in `fine_tune()` (model, kernel probe, compile, run dir,
config + W&B, train with the step chosen on the dev split, evaluate that step on the validation split,
save); finally the report (`Cache/reports/finetune_<time>.{md,json,png}`). The dev split is carved
from the training split with a fixed seed; the validation split is evaluated once per run, after
selection, so no number is selected on the split it is reported on. Decision gates (`--gate
"accuracy>=0.3@100"`, on the task's dev metrics) stop a seed's run that fails one (its best step so far
is still evaluated and saved); the invocation then exits with code 3 (`concept_encoder.gates`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import inspect
import json
import logging
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the project root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from concept_encoder.training.preflight import fail_fast, one_line_errors, preflight

if __name__ == "__main__":  # a bad argument fails in about a second, before torch and the models load
    from concept_encoder.training.args import FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS

    fail_fast(sys.argv[1:], FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS)

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, broadcast_object_list, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoTokenizer, DataCollatorWithPadding

import concept_encoder  # noqa: F401 (registers the Concept Encoder with the Auto classes)
from concept_encoder.gates import GATE_ACTION_TEXT, GATE_EXIT_CODE, GateMonitor, describe_outcome, parse_gates
from concept_encoder.tasks.loading import encode_splits, load_task
from concept_encoder.tasks.metrics import (
    LOWER_IS_BETTER,
    baseline_predictions,
    compute_metrics,
    predictions_from_logits,
)
from concept_encoder.training.args import FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS, parse_args
from concept_encoder.training.batches import accumulation_windows
from concept_encoder.training.checkpoint import (
    TrainState,
    check_resume_settings,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from concept_encoder.training.deepspeed_setup import adamw_class, fill_deepspeed_auto_values, launched_zero_stage
from concept_encoder.training.evaluation import predict
from concept_encoder.training.finetune_report import write_report
from concept_encoder.training.logs import log_model_info, log_system_info, setup_logging
from concept_encoder.training.model import build_classifier
from concept_encoder.training.optim import build_optimizer, build_scheduler
from concept_encoder.training.runs import init_wandb, save_run_config, setup_run_dirs
from concept_encoder.training.runtime import (
    maybe_compile,
    model_state_dict,
    plain_model,
    probe_attention_kernels,
    setup_distributed,
)
from concept_encoder.training.selection import BestStep
from concept_encoder.training.tracking import MetricsWriter, PreemptionFlag

logger = logging.getLogger("concept_encoder")


def model_tag(path: str, from_scratch: bool) -> str:
    """A short name for a model folder in run names and the report (`<run>/final` → `<run>`)."""
    folder = Path(path)
    name = folder.parent.name if folder.name == "final" else folder.name
    return f"{name}{'-scratch' if from_scratch else ''}"


def train_step(accelerator, model, optimizer, window: list[dict], max_grad_norm: float) -> float:
    """One optimizer step over the micro-batches of `window`; returns the last micro-batch's loss."""
    for batch in window:
        with accelerator.accumulate(model):
            out = model(**batch)
            accelerator.backward(out.loss)
            if accelerator.sync_gradients and max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()  # a no-op until the accumulation window is complete
            optimizer.zero_grad(set_to_none=True)
    return out.loss.item()


def fine_tune(state, model_path: str, seed: int, task, splits, tokenizer, fargs, args, run_base: str) -> dict | None:
    """Steps 7-13 for one model and seed; returns the run's result (validation metrics at the chosen step),
    or None when a signal stopped it (after a checkpoint)."""
    started = time.perf_counter()
    tag = model_tag(model_path, fargs.from_scratch)
    run_args = dataclasses.replace(args, run_name=f"{run_base}-{tag}-seed{seed}", seed=seed)
    finished = Path(args.output_dir) / run_args.run_name / "summary.json"
    if args.resume_from_checkpoint and finished.exists():  # resuming an invocation: this seed is done
        logger.info("%s finished before: reusing its result", finished.parent)
        return json.loads(finished.read_text())
    resume = resolve_resume(args.resume_from_checkpoint, args.output_dir, run_args.run_name)
    set_seed(seed)
    # 7. model: the checkpoint's encoder with a fresh task head (or fresh weights with --from_scratch)
    model, note = build_classifier(model_path, task, fargs.from_scratch)
    logger.info("model %s (seed %d): %s", model_path, seed, note)
    counts = log_model_info(model, {"task": task.name, "seed": seed})
    accepted = set(inspect.signature(model.forward).parameters)
    pad = DataCollatorWithPadding(tokenizer)

    def collate(examples):
        return {k: v for k, v in pad(examples).items() if k in accepted}

    loaders = {
        name: DataLoader(split, batch_size=args.per_device_train_batch_size if name == "train" else args.per_device_eval_batch_size,
                         shuffle=name == "train", collate_fn=collate, generator=torch.Generator().manual_seed(seed))
        for name, split in splits.items()
    }  # fmt: skip
    # 8. attention-kernel probe (main process, attention calls of the model's shape)
    probe_attention_kernels(model.config, next(iter(loaders["dev"])), state, decoder=False)
    # 9. optional torch.compile
    model = maybe_compile(model, args.torch_compile)
    # 10. run dir: one per model and seed; a resume must continue the same settings
    settings = {"model": model_path, "from_scratch": fargs.from_scratch, "task": task.name, "seed": seed,
                "world_size": state.num_processes,
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "torch_compile": args.torch_compile}  # fmt: skip
    if resume is not None:
        check_resume_settings(resume, settings)
    run_dir, run_lock = setup_run_dirs(run_args, "finetune", counts["total"], state)
    preemption = PreemptionFlag()  # from here on a signal ends the run with a checkpoint
    try:
        # 11. resolved config saved + logged; W&B
        config = {"finetune_args": dataclasses.asdict(fargs), "task": {"name": task.name, "type": task.task_type,
                  "num_labels": task.num_labels, "sizes": task.sizes(), "metrics": task.metric_names},
                  "training_args": dataclasses.asdict(run_args), "model": model_path, "note": note, "parameters": counts}  # fmt: skip
        if state.is_main_process:
            save_run_config(run_dir, config)
        wandb_run = init_wandb(run_args, run_dir, config, state)
        # 12. Accelerator, prepare, train (checkpoints, preemption, exact resume); select on dev
        accelerator = Accelerator(
            mixed_precision=args.mixed_precision,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed),
        )
        fill_deepspeed_auto_values(accelerator, run_args)
        optimizer = build_optimizer(model, run_args, adamw=adamw_class(accelerator))
        scheduler = build_scheduler(optimizer, run_args)
        model, optimizer, train_loader, dev_loader, validation_loader = accelerator.prepare(
            model, optimizer, loaders["train"], loaders["dev"], loaders["validation"]
        )
        main_metric = task.metric_names[0]
        best = BestStep(main_metric, sign=-1.0 if main_metric in LOWER_IS_BETTER else 1.0)
        accelerator.register_for_checkpointing(scheduler, best)
        progress = TrainState()
        gates = GateMonitor(args.gates)  # on the dev metrics, at every dev evaluation
        if resume is not None:
            progress = load_checkpoint(accelerator, resume)
            gates.load_state_dict({"outcomes": progress.gates})
            logger.info("resumed from %s at step %d", resume, progress.step)
        metrics = MetricsWriter(run_dir / "metrics.jsonl", wandb_run) if accelerator.is_main_process else None
        if metrics:
            metrics.drop_after(progress.step)
        source = accumulation_windows(train_loader, args.gradient_accumulation_steps, progress, lambda batch: batch)
        bar = tqdm(total=args.max_steps, initial=progress.step, desc=f"seed {seed}",
                   disable=not (accelerator.is_main_process and args.progress_bar))  # fmt: skip
        preempted = False
        gate_stopped = bool(gates.failed()) and args.gate_action == "stop"  # a resumed run a gate had stopped
        model.train()
        while progress.step < args.max_steps and not gate_stopped:
            loss = train_step(accelerator, model, optimizer, next(source), args.max_grad_norm)
            scheduler.step()
            progress.step += 1
            step = progress.step
            bar.update(1)
            if metrics and (step % args.logging_steps == 0):
                metrics.write({"kind": "train", "step": step, "loss": loss, "lr": scheduler.get_last_lr()[0]})
            if step % (args.eval_steps or args.max_steps) == 0 or step == args.max_steps:
                logits, labels = predict(accelerator, model, dev_loader)
                dev = compute_metrics(task.metric_names, predictions_from_logits(task.task_type, logits), labels)
                if metrics:
                    metrics.write({"kind": "dev", "step": step, **dev})
                best.offer(step, dev, lambda: model_state_dict(accelerator, model))
                for failure in gates.check(step, dev):
                    logger.warning("seed %d: gate failed: %s; %s", seed, describe_outcome(failure),
                                   GATE_ACTION_TEXT[args.gate_action])  # fmt: skip
                    gate_stopped = args.gate_action == "stop"
                progress.gates = gates.summary()
            stop = torch.tensor(float(preemption.raised), device=accelerator.device)
            preempted = bool(accelerator.reduce(stop, reduction="max").item())
            if preempted or gate_stopped or (args.save_steps and step % args.save_steps == 0):
                save_checkpoint(accelerator, run_dir, progress, args.save_total_limit, None, settings)
            if preempted:
                logger.warning("stopped by signal at step %d; resume with --resume_from_checkpoint auto", step)
                break
        bar.close()
        if preempted:
            accelerator.wait_for_everyone()
            return None
        # 13. the chosen step on the validation split (evaluated once), beside the baseline; save
        plain_model(accelerator, model).load_state_dict(best.weights)
        logits, labels = predict(accelerator, model, validation_loader)
        validation = compute_metrics(task.metric_names, predictions_from_logits(task.task_type, logits), labels)
        baseline = compute_metrics(
            task.metric_names, baseline_predictions(task.task_type, splits["train"]["labels"], len(labels)), labels
        )
        result = {"model": tag, "task": task.name, "seed": seed,
                  "best_step": best.step, "dev": best.dev, "validation": validation, "baseline": baseline,
                  "seconds": round(time.perf_counter() - started, 1), "run_dir": str(run_dir),
                  **({"gates": gates.summary(), "stopped_by_gate": gate_stopped} if args.gate else {})}  # fmt: skip
        if accelerator.is_main_process:
            metrics.write({"kind": "validation", "step": best.step, **validation})
            (run_dir / "summary.json").write_text(json.dumps(result, indent=2))
            plain_model(accelerator, model).save_pretrained(run_dir / "final", state_dict=best.weights)
            tokenizer.save_pretrained(run_dir / "final")
            logger.info("seed %d: step %d chosen on dev (%s %.4f); validation %s; baseline %s", seed, best.step,
                        main_metric, best.dev[main_metric], validation, baseline)  # fmt: skip
            if wandb_run is not None:
                wandb_run.summary.update({f"validation/{k}": v for k, v in validation.items()})
                wandb_run.summary.update({k: result[k] for k in ("gates", "stopped_by_gate") if k in result})
                wandb_run.finish()
        if accelerator.num_processes > 1:  # each rank's view: with gathered predictions they must agree
            (run_dir / "ranks").mkdir(exist_ok=True)
            view = {"best_step": best.step, "dev": best.dev, "validation": validation}
            (run_dir / "ranks" / f"rank{accelerator.process_index}.json").write_text(json.dumps(view))
        accelerator.wait_for_everyone()
        accelerator.free_memory()
        return result
    finally:
        preemption.restore()
        if run_lock is not None:
            run_lock.release()


def main(argv: list[str] | None = None) -> int:
    # 1. distributed setup
    state = setup_distributed()
    # 2. logging
    setup_logging(state, name="finetune")
    # 3. arguments: the model and seeds, the task, the shared optimisation/run settings
    fargs, task_args, args = parse_args(argv, classes=FINETUNE_ARGUMENT_CLASSES, defaults=FINETUNE_DEFAULTS)
    # 4. preflight (every model folder, output folder, precision), seed, system info
    for path in fargs.models:
        preflight(
            dataclasses.replace(fargs, model_name_or_path=path), task_args, args, cuda=state.device.type == "cuda"
        )
    if launched_zero_stage() == 3:  # checked before any run folder is written
        raise ValueError(
            "fine-tuning keeps the weights of the step chosen on dev, which ZeRO-3 partitions across ranks; "
            "use a ZeRO-0/1/2 config (ds_configs/zero2.json), or plain DDP: classifiers of these sizes fit"
        )
    if args.concept_losses:  # a pretraining setting: an error, not a silently ignored flag
        raise ValueError("loops/finetune.py does not support ['--concept_losses'] (concept losses are for pretraining)")
    if args.resume_from_checkpoint not in (None, "auto") or args.resume_from_checkpoint and not args.run_name:
        raise ValueError(
            "fine-tuning resumes with --resume_from_checkpoint auto and the --run_name of the interrupted "
            "invocation (finished seeds are reused, the interrupted one continues from its checkpoint)"
        )
    set_seed(args.seed)
    log_system_info(state)
    # 5-6. the task's splits (train, dev carved with a fixed seed, validation), sizes logged
    task = load_task(task_args)
    parse_gates(args.gate, task.metric_names, f"task {task.name}'s dev split")  # the task's own metrics
    logger.info("task %s (%s, %d labels): %s", task.name, task.task_type, task.num_labels, task.sizes())
    stamp = [f"{dt.datetime.now():%Y%m%d-%H%M%S}"]
    if state.num_processes > 1:
        broadcast_object_list(stamp, from_process=0)  # one name for the run folders on every rank
    run_base = args.run_name or f"ft-{task.name}-{stamp[0]}"
    results = []
    for model_path in fargs.models:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        splits = encode_splits(task, tokenizer, task_args.max_seq_length)
        for seed in range(args.seed, args.seed + fargs.seeds):
            result = fine_tune(state, model_path, seed, task, splits, tokenizer, fargs, args, run_base)
            if result is None:  # stopped by a signal, checkpointed: no report from a partial set of seeds
                return 0
            results.append(result)
    # report: one row per (model, task), mean ± std over seeds, beside the baseline
    if state.is_main_process:
        title = (
            f"Fine-tuning on `{task.name}`: {fargs.seeds} seed(s), {args.max_steps} steps, step chosen on the dev split"
        )
        paths = write_report(results, Path("Cache/reports"), stamp[0], title)
        logger.info("report: %s", ", ".join(str(p) for p in paths.values()))
        print(paths["md"].read_text())
    state.wait_for_everyone()
    stopped = [r for r in results if r.get("stopped_by_gate")]
    if stopped:
        logger.warning("%d run(s) stopped by a gate: %s", len(stopped), ", ".join(r["run_dir"] for r in stopped))
        return GATE_EXIT_CODE
    return 0


if __name__ == "__main__":
    with one_line_errors():
        sys.exit(main())
