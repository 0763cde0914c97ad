"""Pretraining of a Concept Encoder (or the BERT baseline): a plain accelerate loop.

    accelerate launch loops/mlm.py --preset small --dataset embedded --max_steps 300
    accelerate launch loops/mlm.py --objective diffusion          # or tsdae; --architecture bert
    accelerate launch --config_file launch/cpu.yaml loops/mlm.py --config my_run.yaml --learning_rate 1e-3

`main()` reads top to bottom in the project's fixed init order (1-13); the mechanics live in
`concept_encoder.training`, the objectives (`--objective mlm|diffusion|tsdae`: how a batch is
corrupted, which positions are decoded, how each is weighted) in `concept_encoder.data.objectives`.
The loss of an optimizer step is the summed (weighted) cross-entropy of the whole accumulation
window on all ranks divided by the window's token count (masked tokens; eligible tokens for
diffusion's ELBO), not a mean of per-batch means. Decision gates (`--gate
"health/effective_rank_fraction>=0.25@500"`, `concept_encoder.training.gates`) are checked at every evaluation;
a failed one under `--gate_action stop` ends the run with a checkpoint, the final model and exit code 3.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the project root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from concept_encoder.common import json_io
from concept_encoder.common.entry import interrupt_in_one_line, run_tool

if __name__ == "__main__":  # Ctrl-C while the rest imports (transformers, torch: seconds): one line
    interrupt_in_one_line("loops/mlm.py")

from concept_encoder.training.preflight import check_maskable, fail_fast, one_line_errors, preflight

if __name__ == "__main__":  # a bad argument fails in about a second, before torch and the models load
    fail_fast(sys.argv[1:])

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    set_seed,
)
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from concept_encoder.accounting.flops import training_flops_per_token
from concept_encoder.checkpoints.checkpoint import (
    TrainState,
    disk_full,
    load_checkpoint,
    record_cpu_threads,
    resolve_resume,
    save_checkpoint,
    saved_train_state,
    saved_world_size,
    set_aside_later_history,
)
from concept_encoder.checkpoints.export import saved_model_check
from concept_encoder.checkpoints.model_card import write_model_card
from concept_encoder.checkpoints.model_folder import (
    holds_only_saved_model_files,
    save_model_weights,
    save_tokenizer_without_code,
)
from concept_encoder.checkpoints.reshard import plan_universal_load
from concept_encoder.common.accelerator_state import deepspeed_config, plain_model
from concept_encoder.common.faults import NonFiniteLossError, RunFolderError, is_disk_full
from concept_encoder.common.metrics_log import MetricsWriter
from concept_encoder.common.paths import cache_path, written_aside
from concept_encoder.concepts.health import format_health_table, health_of
from concept_encoder.data import collator_for, prepare_data
from concept_encoder.data.objectives import build_corruption, evaluation_corruptions, prepare_batch
from concept_encoder.machine.profiling import StepProfiler
from concept_encoder.tasks.leakage import record_task_texts
from concept_encoder.tasks.loading import training_texts
from concept_encoder.training.args import parse_args
from concept_encoder.training.attention_probe import compute_dtype, examples_of_two_lengths, probe_attention_kernels
from concept_encoder.training.batches import MaskingAhead, pinned, placed
from concept_encoder.training.deepspeed_setup import (
    adamw_class,
    fill_deepspeed_auto_values,
    zero3_construction_config,
)
from concept_encoder.training.distill import Distillation, attach_teacher, carried, init_word_embeddings, with_doc_index
from concept_encoder.training.evaluation import evaluate, most_frequent_token
from concept_encoder.training.gates import (
    GATE_ACTION_TEXT,
    GATE_EXIT_CODE,
    GateMonitor,
    describe_outcome,
    gate_stop_message,
)
from concept_encoder.training.logs import (
    log_data_config,
    log_dataset_sizes,
    log_model_info,
    log_system_info,
    setup_logging,
)
from concept_encoder.training.model import build_model, held_parameters
from concept_encoder.training.objective import build_concept_objective
from concept_encoder.training.optim import build_optimizer, build_scheduler, count_skipped_step
from concept_encoder.training.plan import launch_command
from concept_encoder.training.resume import check_resume_settings, resume_settings
from concept_encoder.training.runs import (
    ended_without_checkpoint,
    finished_run,
    init_wandb,
    keep_run_tokenizer,
    save_run_config,
    setup_run_dirs,
    starting_tokenizer,
)
from concept_encoder.training.runtime import (
    apply_memory_budget,
    finish_distributed,
    maybe_compile,
    model_state_dict,
    set_tf32,
    setup_distributed,
)
from concept_encoder.training.steps import pretraining_step as train_step  # the loop's step (tests patch it here)
from concept_encoder.training.tracking import (
    DivergenceMonitor,
    PreemptionFlag,
    TimeBudget,
    any_rank,
    peak_memory_over_ranks,
    plot_loss_curve,
)

logger = logging.getLogger("concept_encoder")
STREAM_SHUFFLE_BUFFER = 10_000  # examples held by a streamed dataset's shuffle buffer (`--streaming`)


def throughput(interval: dict, flops_per_token: float, world_size: int, peak_tflops: float | None) -> dict:
    """Achieved model TFLOP/s per device (`concept_encoder.accounting.flops`, matmuls only), and MFU against
    `--peak_tflops`."""
    tflops = flops_per_token * interval["tokens"] / interval["time"] / world_size / 1e12
    return {"tflops_per_s": tflops, **({"mfu": tflops / peak_tflops} if peak_tflops else {})}


def save_model_folder(accelerator, model, tokenizer, folder: Path, run_dir: Path, save_dtype: str) -> None:
    """`save_pretrained` + tokenizer into `folder`, written aside and moved into place when complete (a
    folder that exists is whole), the weights in `save_dtype` (float32: DeepSpeed's fp32 masters, not its
    16-bit copies); collective: every rank calls it (ZeRO-3 shards are gathered). A full
    disk removes the partial folder and ends the run with one line naming the last intact checkpoint."""
    state_dict = model_state_dict(accelerator, model)
    if accelerator.is_main_process:
        try:
            with written_aside(folder, replace_existing=True, legacy=holds_only_saved_model_files) as partial:
                save_model_weights(plain_model(accelerator, model), partial, state_dict, save_dtype)
                save_tokenizer_without_code(tokenizer, partial)
        except (OSError, RuntimeError) as error:
            if is_disk_full(error):
                raise disk_full(run_dir, f"the model {folder}") from error
            raise


def save_snapshot(accelerator, model, tokenizer, run_dir: Path, step: int, save_dtype: str) -> None:
    """The model at `step` as `<run>/snapshots/step-<step>` (`--snapshot_steps`; a resume rewrites it identically)."""
    folder = run_dir / "snapshots" / f"step-{step}"
    save_model_folder(accelerator, model, tokenizer, folder, run_dir, save_dtype)
    if accelerator.is_main_process:
        logger.info("snapshot at step %d: %s", step, folder)
    accelerator.wait_for_everyone()


def save_final(
    accelerator,
    model,
    tokenizer,
    probe_ids,
    run_dir: Path,
    progress: TrainState,
    preempted: bool,
    last_eval,
    wandb_run,
    notes: dict | None = None,
    held: dict | None = None,
    save_dtype: str = "float32",
):
    """Final model (`save_pretrained` + tokenizer in `save_dtype`, ZeRO-3 shards gathered), export check, loss
    curve, summary, W&B finish.

    Export check: the in-training model's logits on `probe_ids [1,N]` are compared with those of the saved folder
    reloaded and run like the run's model (same device, dtype and autocast: `export.saved_model_check`), which
    catches a broken ZeRO-3 gather or a lost tied weight at the end of the run, not later; beyond its tolerance
    the run is marked (a warning, `export_check.passed: false` in `summary.json`).
    With several processes each rank also writes `ranks/rank<r>.json` (its view of the last eval
    loss and a checksum of its parameters), so a run can show that the ranks agree, and `held`: the parameter
    elements it held right after construction (`held_parameters`; a fraction of the total under ZeRO-3).
    """
    accelerator.wait_for_everyone()
    final_dir = run_dir / "final"
    check = None
    if not preempted:
        model.eval()
        with torch.no_grad():  # every rank runs it: under ZeRO-3 the forward gathers parameters
            reference = model(input_ids=probe_ids.to(accelerator.device)).logits.float().cpu()
        save_model_folder(accelerator, model, tokenizer, final_dir, run_dir, save_dtype)
        if accelerator.is_main_process:
            check = saved_model_check(accelerator, model, final_dir, probe_ids, reference)
            if check["passed"]:
                logger.info("export check: the reloaded final model matches the trained one to %.2e (max |Δlogit|, "
                            "%s on %s)", check["max_abs_diff"], check["dtype"], check["device"])  # fmt: skip
            else:
                logger.warning("export check failed: the reloaded final model differs from the trained one by %.2e "
                               "(max |Δlogit|) > %g (%s on %s): the saved weights are not the trained ones (a lost "
                               "ZeRO-3 gather or tied weight?); summary.json marks it", check["max_abs_diff"],
                               check["tolerance"], check["dtype"], check["device"])  # fmt: skip
    if accelerator.num_processes > 1:
        params = list(plain_model(accelerator, model).parameters())
        sharded = any(hasattr(p, "ds_numel") for p in params)  # ZeRO-3 holds only a shard per rank
        checksum = None if sharded else sum(float(p.detach().double().sum()) for p in params)
        (run_dir / "ranks").mkdir(exist_ok=True)
        view = {"eval_loss": (last_eval or {}).get("eval_loss"), "param_checksum": checksum, "step": progress.step,
                "held_at_construction": held}  # fmt: skip
        (run_dir / "ranks" / f"rank{accelerator.process_index}.json").write_text(json_io.dumps(view))
    if accelerator.is_main_process:
        plot = plot_loss_curve(run_dir / "metrics.jsonl", run_dir / "loss_curve.png")
        summary = {
            "steps": progress.step,
            "tokens_seen": progress.tokens_seen,
            "train_seconds": progress.seconds,  # the training loop's wall-clock, over every invocation of the run
            "mixed_precision": accelerator.mixed_precision,  # what ran (flag, launch config or default)
            "preempted": preempted,
            "export_max_abs_diff": None if check is None else check["max_abs_diff"],
            "export_check": check,
            **(last_eval or {}),
            **(notes or {}),  # e.g. a detected divergence
        }
        (run_dir / "summary.json").write_text(json_io.dumps(summary, indent=2))
        health = health_of(last_eval or {})
        if health:
            logger.info("concept health at the last evaluation:\n%s", format_health_table(health))
        logger.info("run dir: %s", run_dir)
        if not preempted:
            logger.info("final model: %s (AutoModelForMaskedLM.from_pretrained loads it)", final_dir)
        logger.info("metrics: %s, loss curve: %s, log: Cache/logs/", run_dir / "metrics.jsonl", plot)
        if wandb_run is not None:
            wandb_run.summary.update({k: v for k, v in (notes or {}).items() if k in ("gates", "stopped_by_gate")})
            wandb_run.finish()


def main(argv: list[str] | None = None) -> int:
    # 1. distributed setup: backend (NCCL on CUDA, gloo on CPU), timeout, device
    state = setup_distributed()
    # 2. logging: INFO + file log on the main process, ERROR elsewhere
    setup_logging(state)
    # 3. arguments: dataclasses, optional YAML, CLI overrides
    model_args, data_args, args = parse_args(argv)
    # 4. preflight (nothing heavy built yet), seed, system info, data config
    preflight(model_args, data_args, args, cuda=state.device.type == "cuda")
    resume = resolve_resume(args.resume_from_checkpoint, args.output_dir, args.run_name)  # checked, not loaded
    if args.teacher_embedding_init and zero3_construction_config(args, state.num_processes) is not None:
        raise ValueError(
            "--teacher_embedding_init writes the student's embedding table before training, which ZeRO-3 holds in "
            "shards from construction on: use ZeRO 0-2 (ds_configs/zero2.json) for a run that starts from it"
        )
    set_seed(args.seed)
    apply_memory_budget(args.cuda_memory_budget_gb, state)
    system = log_system_info(state)
    log_data_config(data_args, args.per_device_train_batch_size, args.objective)  # warns if masks can come out empty
    # 5. tokenizer + datasets (a resume uses the run's own tokenizer: trained ones differ between trainings; a start
    #    from a model folder uses the folder's, the one its weights were trained with; a mixture's task:<name>
    #    sources are the task's training texts)
    kept = starting_tokenizer(resume, model_args.model_name_or_path, data_args.tokenizer)
    data = prepare_data(data_args, cache_dir="Cache", seed=args.seed + state.process_index,  # own masks per rank
                        tokenizer_folder=kept if kept is not None and kept.is_dir() else None,
                        task_texts=training_texts)  # fmt: skip
    if resume is None:  # a tokenizer that leaves nothing to mask (NaN loss every step); a resume: its vocab digest
        check_maskable(data)
    corruption = build_corruption(
        args.objective, data.collator, data.tokenizer, args, seed=args.seed + state.process_index
    )
    distilling = args.objective == "distill"  # the teacher embeds every document once (cached), before the model
    targets = attach_teacher(data, args, data_args.max_seq_length, cache_path("Cache")) if distilling else None
    # 6. dataset sizes after load/filter/packing
    log_dataset_sizes(data)
    # 7. model config, loss config, model (partitioned as it is built under ZeRO-3)
    zero3_config = zero3_construction_config(args, state.num_processes)
    model = build_model(model_args, data_args, data.tokenizer, args.objective, args.seed, zero3_config)
    record_task_texts(model.config, data_args.dataset)  # so fine-tuning refuses to score it on text it read
    if args.teacher_embedding_init:
        init_word_embeddings(model, args.teacher, data.tokenizer)
    held = held_parameters(model)
    if zero3_config is not None:
        logger.info("ZeRO-3 partitioned model: this process holds %d of %d parameter elements", held["local"],
                    held["total"])  # fmt: skip
    counts = log_model_info(
        model,
        {"preset": model_args.preset, "architecture": model_args.architecture, "objective": args.objective,
         "decoder": getattr(model.config, "decoder_type", None)},
    )  # fmt: skip
    flops_per_token = training_flops_per_token(  # packed blocks are full: FLOPs per token at that length
        model.config.to_dict(), data_args.max_seq_length, args.objective, data_args.mlm_probability,
        args.t_min, args.deletion_rate,
    )  # fmt: skip
    concept = build_concept_objective(args, model.config, state.device)
    distill = Distillation(targets, model.config.hidden_size, args, state.device) if distilling else None
    # 8. attention-kernel probe (main process, attention calls of the model's shape; the model stays put)
    eval_collator = collator_for(data_args, data.tokenizer, seed=args.seed + 1)  # same masks at every eval
    eval_collator_state = eval_collator.state_dict()
    extra_evals = evaluation_corruptions(args.objective, data.tokenizer, args, seed=args.seed + 1)
    extra_eval_states = {name: extra.state_dict() for name, extra in extra_evals.items()}
    first_validation_example = next(iter(data.validation))  # also for the export check at the end
    unigram_id = most_frequent_token(data.validation, data.tokenizer)  # the baseline every eval is set beside
    probe_batch = eval_collator.collate(examples_of_two_lengths(data.validation))  # padded as the run pads
    probe_attention_kernels(model.config, probe_batch, state, compute_dtype(args.mixed_precision))
    system["tf32"] = set_tf32(args.tf32, state)
    # 9. optional torch.compile
    model = maybe_compile(model, args.torch_compile)
    # 10. run dirs + argument guards: nothing is written before a resume is known to fit
    settings = resume_settings(model.config, model_args, data_args, args, state.num_processes, data.tokenizer)
    if resume is not None:
        check_resume_settings(resume, settings)
        failed = [o for o in saved_train_state(resume).gates if o["passed"] is False]
        if failed and args.gate_action == "stop":  # a gate stopped this run: nothing is opened or written
            logger.error(gate_stop_message(failed, resumed=True))
            return GATE_EXIT_CODE
    run_dir, run_lock = setup_run_dirs(
        args, model_args.preset, counts["total"], state, resume_dir=resume.parent.parent if resume else None
    )
    if args.resume_from_checkpoint == "auto" and (done := finished_run(run_dir, args.max_steps)):
        logger.info(done)
        if run_lock is not None:
            run_lock.release()
        return 0
    if (
        args.resume_from_checkpoint == "auto"
        and resume is None
        and (gap := ended_without_checkpoint(run_dir, args.max_steps))
    ):
        if run_lock is not None:
            run_lock.release()
        raise RunFolderError(gap)
    if resume is not None and resume.parent.parent.resolve() == run_dir.resolve() and state.is_main_process:
        set_aside_later_history(run_dir, saved_train_state(resume).step)  # one history: a rollback keeps the other
    if state.is_main_process:
        keep_run_tokenizer(run_dir, data.tokenizer)  # written once: what every resume of this run loads
    eval_steps = args.eval_steps or args.max_steps  # 0 means: evaluate at the end only
    save_steps = args.save_steps or None
    snapshot_steps = set(args.snapshot_step_list)
    kept_checkpoints = frozenset(args.checkpoint_step_list)  # branch points, beyond the rotation
    # 11. resolved config saved + logged; W&B
    config = {
        "model_args": dataclasses.asdict(model_args),
        "data_args": dataclasses.asdict(data_args),
        "training_args": dataclasses.asdict(args),
        "model_config": model.config.to_dict(),
        "parameters": counts,
        "system": system,
        "data_stats": data.stats,
        "run_dir": str(run_dir),
    }
    if state.is_main_process:
        save_run_config(run_dir, config)
    wandb_run = init_wandb(args, run_dir, config, state)
    # 12. Accelerator, prepare, train
    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,  # None: the launch config's; fills a ds config's "auto" too
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
    )
    fill_deepspeed_auto_values(accelerator, args)
    optimizer = build_optimizer(model, args, adamw=adamw_class(accelerator))
    scheduler = build_scheduler(optimizer, args)
    if data.streaming:  # shuffled by the stream's buffer, reseeded each epoch by `loader.set_epoch`
        train_source, order = data.train.shuffle(seed=args.seed, buffer_size=STREAM_SHUFFLE_BUFFER), {}
    else:
        train_source, order = data.train, {"shuffle": True}
    train_loader = DataLoader(
        train_source,
        batch_size=args.per_device_train_batch_size,
        drop_last=True,
        collate_fn=with_doc_index(data.collator.collate) if distilling else data.collator.collate,  # padding only
        num_workers=args.dataloader_num_workers,
        persistent_workers=args.dataloader_num_workers > 0,  # no new worker processes every epoch
        # not pinned here: masking makes new tensors, pinned after it (`batches.pinned`)
        generator=torch.Generator().manual_seed(args.seed),  # keeps loader seeding off the global RNG
        **order,
    )
    eval_loader = DataLoader(
        data.validation,
        batch_size=args.per_device_eval_batch_size,
        collate_fn=with_doc_index(eval_collator.collate) if distilling else eval_collator.collate,
        generator=torch.Generator().manual_seed(args.seed),
    )
    if resume is not None:  # a DeepSpeed checkpoint of another process count loads as a universal checkpoint
        plan_universal_load(deepspeed_config(accelerator), resume, saved_world_size(resume), state.num_processes)
    model, optimizer = accelerator.prepare(model, optimizer)
    train_loader = accelerator.prepare_data_loader(train_loader, device_placement=False)  # masked on CPU first
    eval_loader = accelerator.prepare_data_loader(eval_loader, device_placement=False)
    masking = MaskingAhead(corruption, ahead=args.dataloader_num_workers > 0)  # masks the next window during a step
    shared, per_rank = {"scheduler": scheduler, "concept": concept}, {"collator": masking}  # checkpointed
    if distill is not None:
        shared["distill"] = distill
    progress_state = TrainState()
    gates = GateMonitor(args.gates)
    if resume is not None:
        progress_state = load_checkpoint(accelerator, resume, per_rank, shared, run_dir)
        gates.load_state_dict({"outcomes": progress_state.gates})
        logger.info("resumed from %s at step %d", resume, progress_state.step)
    threads = record_cpu_threads(progress_state, accelerator.device.type)  # CPU sums depend on the count
    run_clock = time.perf_counter() - progress_state.seconds  # the run's wall-clock counts earlier invocations

    metrics = MetricsWriter(run_dir / "metrics.jsonl", wandb_run) if accelerator.is_main_process else None
    if metrics:
        metrics.drop_after(progress_state.step)  # a resume rewrites the steps after its checkpoint
    preemption = PreemptionFlag()
    bar = tqdm(
        total=args.max_steps,
        initial=progress_state.step,
        disable=not (accelerator.is_main_process and args.progress_bar),
        desc="train",
        dynamic_ncols=True,
    )
    window_source = masking.windows(
        train_loader,
        args.gradient_accumulation_steps,
        progress_state,
        lambda batch: pinned(prepare_batch({**corruption.mask(batch), **carried(batch)}), accelerator.device),
        lambda batch: placed(batch, accelerator.device),  # queued behind the step before it: no host sync
    )
    profiler = StepProfiler(args.profile_step_range, run_dir, accelerator.is_main_process, progress_state.step)
    interval = {"loss": 0.0, "labelled": 0, "tokens": 0, "steps": 0, "time": 0.0}
    unlabelled_steps = 0
    divergence = DivergenceMonitor()
    last_eval = None
    preempted = False
    gate_stopped = False
    out_of_time = False
    budget = TimeBudget(args.max_time_s)  # --max_time: this invocation's training time
    model.train()
    while progress_state.step < args.max_steps:
        profiler.step(progress_state.step)  # --profile_steps: one profiler step per optimizer step
        started = time.perf_counter()
        step = train_step(
            accelerator,
            model,
            optimizer,
            next(window_source),
            args.max_grad_norm,
            concept,
            progress_state.step,
            distill,
        )
        if step["applied"]:
            scheduler.step()
        count_skipped_step(progress_state, step["applied"], "loss" if not math.isfinite(step["loss"]) else
                           "gradient norm", args.max_bad_steps, "lower the learning rate, use bf16 instead of fp16, "
                           "or check the data")  # fmt: skip
        progress_state.step += 1
        progress_state.tokens_seen += step["tokens"]
        if step["labelled"] == 0:  # nothing was predicted: the step's loss is undefined, not 0
            unlabelled_steps += 1
            logger.warning(
                "step %d had no masked token on any rank (loss undefined, logged as NaN)", progress_state.step
            )
        elapsed = time.perf_counter() - started
        interval["loss"] += step["loss"] * step["labelled"]
        interval["labelled"] += step["labelled"]
        interval["tokens"] += step["tokens"]
        interval["steps"] += 1
        interval["time"] += elapsed
        bar.update(1)

        if progress_state.step % args.logging_steps == 0 or progress_state.step == args.max_steps:
            record = {
                "kind": "train",
                "step": progress_state.step,
                "epoch": progress_state.epoch,
                "loss": interval["loss"] / interval["labelled"] if interval["labelled"] else math.nan,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": step["grad_norm"],
                "tokens_per_s": interval["tokens"] / interval["time"],
                "masked_tokens_per_s": interval["labelled"] / interval["time"],
                **throughput(interval, flops_per_token, accelerator.num_processes, args.peak_tflops),
                "step_time_s": interval["time"] / interval["steps"],
                "tokens_seen": progress_state.tokens_seen,
                **step["terms"],  # concept/<loss>, distill/<loss>
                **peak_memory_over_ranks(accelerator),
            }
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            if diverged := divergence.update(progress_state.step, record["loss"]):
                logger.warning(
                    "the loss diverges: %.3f at step %d against a running minimum of %.3f; lower --learning_rate "
                    "or raise --warmup_steps (the run goes on; summary.json records this)",
                    diverged["loss"], diverged["step"], diverged["running_min"],
                )  # fmt: skip
            if metrics:
                metrics.write(record)
            logger.info(
                "step %d: %s", progress_state.step, {k: v for k, v in record.items() if k not in ("kind", "step")}
            )
            interval = {"loss": 0.0, "labelled": 0, "tokens": 0, "steps": 0, "time": 0.0}

        at_snapshot = progress_state.step in snapshot_steps  # a snapshot's eval loss belongs beside it
        if progress_state.step % eval_steps == 0 or progress_state.step == args.max_steps or at_snapshot:
            last_eval = evaluate(
                accelerator, model, eval_loader, eval_collator, eval_collator_state, args.max_eval_batches,
                unigram_id=unigram_id,
            )  # fmt: skip
            for name, extra in extra_evals.items():  # the objective's own yardsticks, e.g. loss at t=0.5
                results = evaluate(
                    accelerator, model, eval_loader, extra, extra_eval_states[name], args.max_eval_batches, health=False
                )
                last_eval.update({f"eval_{key.removeprefix('eval_')}_{name}": v for key, v in results.items()})
            if distill is not None:  # the projected student against the teacher, on the clean validation texts
                last_eval.update(distill.evaluate(accelerator, model, eval_loader, args.max_eval_batches))
            if metrics:
                metrics.write({"kind": "eval", "step": progress_state.step, **last_eval})
            logger.info("eval at step %d: %s", progress_state.step, last_eval)
            for failure in gates.check(progress_state.step, last_eval):
                logger.warning("gate failed: %s; %s", describe_outcome(failure), GATE_ACTION_TEXT[args.gate_action])
                gate_stopped = args.gate_action == "stop"
            progress_state.gates = gates.summary()

        if at_snapshot:
            save_snapshot(accelerator, model, data.tokenizer, run_dir, progress_state.step, args.save_dtype)
        preempted, out_of_time = any_rank(accelerator, preemption.raised, budget.spent())
        out_of_time = out_of_time and progress_state.step < args.max_steps
        periodic = save_steps and progress_state.step % save_steps == 0
        if preempted or gate_stopped or out_of_time or periodic or progress_state.step in kept_checkpoints:
            progress_state.seconds = round(time.perf_counter() - run_clock, 1)
            save_checkpoint(accelerator, run_dir, progress_state, args.save_total_limit, per_rank, settings, shared,
                            kept_checkpoints)  # fmt: skip
        if gate_stopped:
            logger.warning(gate_stop_message(gates.failed()))
            break
        if out_of_time and not preempted:
            logger.warning(budget.stop_message(progress_state.step, args.max_steps))
            break
        if preempted:
            logger.warning(
                "stopped by signal at step %d; resume with --resume_from_checkpoint auto", progress_state.step
            )
            break
    profiler.stop(progress_state.step)
    bar.close()
    progress_state.seconds = round(time.perf_counter() - run_clock, 1)

    # 13. final save + W&B finish (main process)
    probe_ids = torch.as_tensor(first_validation_example["input_ids"], dtype=torch.long)[None]  # [1,N]
    notes = {"cpu_threads": threads, **({"divergence": divergence.detected} if divergence.detected else {})}
    if unlabelled_steps:
        notes["steps_without_masked_tokens"] = unlabelled_steps
    if args.gate:
        notes["gates"] = gates.summary()
        notes["stopped_by_gate"] = gate_stopped
    if args.max_time is not None:
        notes["max_time"] = {"budget_s": budget.seconds, "spent_s": round(budget.elapsed(), 1),
                             "stopped_by_max_time": out_of_time and not preempted}  # fmt: skip
    save_final(
        accelerator, model, data.tokenizer, probe_ids, run_dir, progress_state, preempted, last_eval, wandb_run, notes,
        held, args.save_dtype,
    )  # fmt: skip
    if accelerator.is_main_process and not preempted:
        summary = json.loads((run_dir / "summary.json").read_text())
        command = launch_command([], model_args, data_args, args)
        write_model_card(run_dir / "final", run_dir.name, config, summary, command)
    finish_distributed(accelerator, model)  # in-flight gathers drained, ranks met, process group destroyed
    preemption.restore()  # only now: a second signal (e.g. the launcher's death after it forwarded one) must not kill the final save
    if run_lock is not None:
        run_lock.release()
    if preempted:  # checkpointed, not finished: 128 + the signal's number, so `loop && next` stops here
        return preemption.exit_code
    return GATE_EXIT_CODE if gate_stopped else 0


if __name__ == "__main__":
    with one_line_errors(NonFiniteLossError):
        sys.exit(run_tool(main, "loops/mlm.py"))
