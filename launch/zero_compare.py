"""ZeRO memory comparison runs: the same model, batch and sequence length under each ds config.

    python launch/zero_compare.py --configs zero0,zero2,zero2_offload,zero3_offload --preset large \\
        --per_device_train_batch_size 8 --max_seq_length 512 --steps 10 --memory_budget 10GB
    python launch/zero_compare.py --configs zero2,zero2_offload --find_max --memory_budget 10GB [--find_max_from xl]

It lives beside the plan checker because it is the plan checker's measured counterpart: both take
the loop's own flags (parsed by the loop's parser, here with a micro-batch of 8 by default), build
the launch with the same `launch_command` and ask the same memory model; this one launches and measures.

Each config runs `loops/mlm.py` in its own `accelerate launch` process for `--untimed_steps`
plus `--steps` optimizer steps. Measured: peak CUDA memory allocated and reserved (max over
ranks, where CUDA exists), peak host RSS (max over ranks), median step time, tokens/s and the
final loss; beside them the analytic estimate (`concept_encoder.accounting.memory`: DeepSpeed's ZeRO
estimators plus the buffers the ds config sets and our activation model; on the host, process baselines, fp32
models and offloaded states) and its error against the measurement. A config that fails (OOM, missing op) gets
a row with the error and the comparison goes on. A run whose estimated host memory exceeds what this machine
has available (/proc/meminfo MemAvailable) is not launched: its row says why (`--find_max` stops there, the
larger presets needing more). Writes `Cache/reports/zero_compare_<time>.{csv,md,png}` and prints the markdown
table.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from concept_encoder.accounting.memory import (  # noqa: E402
    GIB,
    describe_host,
    estimate_training_memory,
    parse_size_gb,
    zero_settings,
)
from concept_encoder.common import process_group  # noqa: E402
from concept_encoder.common.cli_types import at_least  # noqa: E402
from concept_encoder.common.faults import written_whole  # noqa: E402
from concept_encoder.common.report_files import ReportFolderError, check_report_dir, claim_report_folder  # noqa: E402
from concept_encoder.machine.checks import host_memory_bytes  # noqa: E402
from concept_encoder.training.args import parse_args as parse_loop_args  # noqa: E402
from concept_encoder.training.plan import (  # noqa: E402
    LOOP_SCRIPT,
    PYTHON_ACCELERATE_LAUNCH,
    fresh_model_fields,
    launch_command,
)
from launch.plan_checks import tokenizer_info  # noqa: E402

PRESET_ORDER = ["micro", "tiny", "small", "base", "large", "xl", "3b"]
COLUMNS = [
    "config", "preset", "status", "cuda_peak_allocated_gb", "cuda_peak_reserved_gb", "rss_gb", "est_rss_gb",
    "rss_error_pct", "est_host_gb", "est_gpu_peak_gb", "est_model_states_gpu_gb", "est_model_states_cpu_gb",
    "est_zero_buffers_gb", "est_activations_gb", "est_error_pct", "median_step_s", "tokens_per_s", "final_loss",
    "error", "note",
]  # fmt: skip


def size_argument(text: str) -> float:
    try:
        return parse_size_gb(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def run_arguments(args, preset: str, run_dir: Path) -> tuple:
    """The loop's arguments for one measured run: the user's, with the preset, step counts and
    outputs of this comparison (logging every step, no checkpoints, evaluation on one batch)."""
    model, data, train = args.loop
    train = dataclasses.replace(
        train, max_steps=args.untimed_steps + args.steps, logging_steps=1, eval_steps=0, max_eval_batches=1,
        save_steps=0, report_to="none", progress_bar=False, output_dir=str(run_dir.parent), run_name=run_dir.name,
        mixed_precision=args.mixed_precision, cuda_memory_budget_gb=args.memory_budget,
    )  # fmt: skip
    return dataclasses.replace(model, preset=preset), data, train


def run_command(args, config: str, preset: str, run_dir: Path, port: int) -> list[str]:
    accelerate = ["--num_machines", "1", "--num_processes", str(args.num_processes), "--main_process_port", str(port)]
    accelerate += ["--dynamo_backend", "no"]
    if config == "none":
        accelerate += ["--multi_gpu"] if args.num_processes > 1 else []
    else:
        accelerate += ["--use_deepspeed", "--deepspeed_config_file", str(ROOT / "ds_configs" / f"{config}.json")]
        accelerate += ["--deepspeed_multinode_launcher", "standard"]
    return launch_command(accelerate, *run_arguments(args, preset, run_dir), launcher=PYTHON_ACCELERATE_LAUNCH,
                          script=str(ROOT / LOOP_SCRIPT))  # fmt: skip


def last_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if re.search(r"(Error|error:|Exception|out of memory)", line)]
    return (lines[-1] if lines else text.strip().splitlines()[-1] if text.strip() else "unknown failure")[:300]


def measure(args, config: str, preset: str, report_dir: Path, port: int) -> dict:
    """One `accelerate launch` of the loop under `config`, its measurements and the estimate; not launched when
    the estimated host memory exceeds what this machine has available (status `skipped`, the reason in `error`)."""
    run_dir = report_dir / "runs" / f"{config}-{preset}"
    row: dict = {"config": config, "preset": preset}
    if reason := host_shortfall(estimate_for(args, config, preset, run_dir)):
        row.update(status="skipped", error=reason)
    else:
        row.update(launch_and_read(args, config, preset, run_dir, report_dir / "logs" / f"{config}-{preset}.log", port))
    row.update(estimate(args, config, preset, run_dir, row))
    return row


def host_shortfall(est) -> str | None:
    """Why a run does not fit this machine's host RAM now (`describe_host` against MemAvailable); None if it does,
    or if the machine's memory cannot be read."""
    have = host_memory_bytes("MemAvailable")
    if have is None or est.host_peak <= have:
        return None
    return (
        f"needs {describe_host(est)}, this machine has {have / GIB:.1f} GiB available (MemAvailable): not launched; "
        "free memory, or compare a smaller preset"
    )


def launch_and_read(args, config: str, preset: str, run_dir: Path, log_path: Path, port: int) -> dict:
    """Launch the run and read its metrics: status, step time, tokens/s, loss, peak RSS and CUDA memory."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        done = process_group.run(
            run_command(args, config, preset, run_dir, port), args.timeout, cwd=args.workdir, env=env
        )
        log_path.write_text(done.stdout + "\n" + done.stderr)
        failed = done.returncode != 0
        error = last_error(done.stderr) if failed else ""
    except subprocess.TimeoutExpired:
        failed, error = True, f"timed out after {args.timeout}s"
    metrics_path = run_dir / "metrics.jsonl"
    records = []
    if metrics_path.exists():
        records = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    timed = train[args.untimed_steps :] or train
    if failed or not timed:
        return {"status": "failed", "error": error or "no metrics written"}
    step_s = statistics.median(r["step_time_s"] for r in timed)
    tokens_per_step = timed[-1]["tokens_seen"] / timed[-1]["step"]
    return {
        "status": "ok",
        "median_step_s": round(step_s, 4),
        "tokens_per_s": round(tokens_per_step / step_s, 1),
        "final_loss": round(train[-1]["loss"], 4),
        "rss_gb": max(r["rss_gb"] for r in train),
        "cuda_peak_allocated_gb": max(
            (r["cuda_peak_allocated_gb"] for r in train if "cuda_peak_allocated_gb" in r), default=None
        ),
        "cuda_peak_reserved_gb": max(
            (r["cuda_peak_reserved_gb"] for r in train if "cuda_peak_reserved_gb" in r), default=None
        ),
    }


def ds_config_of(config: str) -> dict | None:
    return None if config == "none" else json.loads((ROOT / "ds_configs" / f"{config}.json").read_text())


def estimate_for(args, config: str, preset: str, run_dir: Path):
    """The memory model's estimate of one run: the vocabulary the run used (its config.json), else the one its
    tokenizer spec names (`train:wordpiece:8000`), else BERT's 30,522; on a machine without CUDA as the loop runs
    there (device side in host RAM, the math attention kernel)."""
    config_path = run_dir / "config.json"
    if config_path.exists():
        vocab = json.loads(config_path.read_text())["model_config"]["vocab_size"]
    else:
        vocab = tokenizer_info(args.loop[1].tokenizer).get("vocab_size") or 30522
    model, data, train = run_arguments(args, preset, run_dir)
    ds_config = ds_config_of(config)
    stage, offload_opt, offload_par = zero_settings(ds_config)
    return estimate_training_memory(
        fresh_model_fields(model, data.max_seq_length, vocab_size=vocab),
        train.per_device_train_batch_size,
        data.max_seq_length,
        zero_stage=stage,
        offload_optimizer=offload_opt,
        offload_params=offload_par,
        gpus_per_node=args.num_processes,
        mixed_precision=args.mixed_precision,
        gradient_checkpointing=model.gradient_checkpointing,
        mlm_probability=data.mlm_probability,
        fused_attention=args.has_cuda,
        ds_config=ds_config,
        cpu_run=not args.has_cuda,
    )


def estimate(args, config: str, preset: str, run_dir: Path, measured: dict) -> dict:
    """The estimate's columns, and its errors against the measured CUDA peak reserved (the caching allocator's
    share: the estimate less the CUDA context) and the peak RSS of the largest rank."""
    est = estimate_for(args, config, preset, run_dir)
    rss = est.host_per_process + est.host_offloaded / est.processes
    out = {
        "est_rss_gb": round(rss / GIB, 3),
        "est_host_gb": round(est.host_peak / GIB, 3),
        "est_gpu_peak_gb": round(est.gpu_peak / GIB, 3),
        "est_model_states_gpu_gb": round(est.gpu_model_states / GIB, 3),
        "est_model_states_cpu_gb": round(est.cpu_model_states / GIB, 3),
        "est_zero_buffers_gb": round(est.zero_buffers / GIB, 3),
        "est_activations_gb": round(est.activations / GIB, 3),
    }
    if measured.get("cuda_peak_reserved_gb"):
        out["est_error_pct"] = round(100 * (est.allocator_peak / GIB / measured["cuda_peak_reserved_gb"] - 1), 1)
    if measured.get("rss_gb"):
        out["rss_error_pct"] = round(100 * (out["est_rss_gb"] / measured["rss_gb"] - 1), 1)
    return out


def format_markdown(rows: list[dict], args, has_cuda: bool) -> str:
    model, data, train = args.loop
    lines = [
        f"ZeRO comparison: preset {model.preset if not args.find_max else 'largest that fits'}, micro-batch "
        f"{train.per_device_train_batch_size}, seq {data.max_seq_length}, {args.num_processes} process(es), "
        f"{args.mixed_precision}, {args.steps} timed steps after {args.untimed_steps} untimed"
        + (f", CUDA capped at {args.memory_budget:g} GiB" if args.memory_budget else ""),
        "",
    ]
    if not has_cuda:
        lines += ["No CUDA on this machine: GPU columns are unavailable (—); host RSS and step time are measured.", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join("—" if row.get(c) in (None, "") else str(row[c]) for c in COLUMNS) + " |")
    lines += [
        "",
        "est_*: analytic estimate per GPU (DeepSpeed's ZeRO-2/3 estimators + the ZeRO buffers the ds config sets + "
        "our activation model + 0.75 GiB workspace, of which 0.5 GiB CUDA context); est_error_pct compares it, less "
        "the CUDA context, with the measured CUDA peak reserved. est_rss_gb: host memory per process (baseline, "
        "fp32 model, offloaded states, on a CPU run the device side), rss_error_pct against the largest rank's RSS; "
        "est_host_gb: per machine. A run whose est_host_gb exceeds the machine's available RAM is skipped.",
    ]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, has_cuda: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    labels = [f"{r['config']}\n{r['preset']}" for r in rows]
    fig, (ax_mem, ax_tp) = plt.subplots(1, 2, figsize=(13, 4.5))
    series = [("est_gpu_peak_gb", "estimated GPU peak")]
    if has_cuda:
        series = [
            ("cuda_peak_allocated_gb", "CUDA peak allocated"),
            ("cuda_peak_reserved_gb", "CUDA peak reserved"),
        ] + series
    series.append(("rss_gb", "host RSS (max rank)"))
    width = 0.8 / len(series)
    for i, (key, name) in enumerate(series):
        values = [r.get(key) or 0 for r in rows]
        ax_mem.bar([x + i * width for x in range(len(rows))], values, width, label=name)
    ax_mem.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels, fontsize=8)
    ax_mem.set_ylabel("GiB")
    ax_mem.set_title("memory per configuration")
    ax_mem.legend(fontsize=8)
    ax_tp.bar([f"{r['config']}\n{r['preset']}" for r in ok], [r["tokens_per_s"] for r in ok], color="tab:green")
    ax_tp.set_ylabel("tokens/s")
    ax_tp.set_title("throughput (failed configs omitted)")
    ax_tp.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


LOOP_DEFAULTS = {"per_device_train_batch_size": 8}  # a comparison, not a training run: smaller than the loop's 16


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
        epilog="Every other flag is one of loops/mlm.py's (see its --help), parsed by the loop's own parser.",
    )
    parser.add_argument("--configs", default="zero0,zero1,zero2,zero2_offload,zero3,zero3_offload",
                        help="comma-separated ds config names (ds_configs/<name>.json), or `none` for plain DDP")  # fmt: skip
    parser.add_argument("--steps", type=at_least(1), default=5, help="timed optimizer steps per config")
    parser.add_argument("--untimed_steps", type=at_least(0), default=2, help="steps run first and not timed")
    parser.add_argument("--num_processes", type=at_least(1), default=1)
    parser.add_argument("--memory_budget", type=size_argument, default=None, help="cap CUDA memory, e.g. 10GB")
    parser.add_argument("--find_max", action="store_true", help="largest preset that completes under each config")
    parser.add_argument("--find_max_from", default=PRESET_ORDER[0], choices=PRESET_ORDER,
                        help="--find_max: the smallest preset tried (default micro; skip the ones known to fit)")  # fmt: skip
    parser.add_argument("--out_dir", default="Cache/reports")
    parser.add_argument("--workdir", default=str(ROOT), help="where the runs' Cache/ (data, tokenizers) lives")
    parser.add_argument("--timeout", type=at_least(1), default=1800, help="seconds per run")
    parser.add_argument("--port", type=at_least(1024), default=29720)
    args, loop_argv = parser.parse_known_args(argv)
    try:
        args.loop = parse_loop_args(loop_argv, defaults=LOOP_DEFAULTS)
    except ValueError as error:
        parser.error(str(error))
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c != "none" and not (ROOT / "ds_configs" / f"{c}.json").exists()]
    if unknown:
        parser.error(
            f"unknown ds config(s) {unknown}; choose from {sorted(p.stem for p in (ROOT / 'ds_configs').glob('*.json'))}"
        )
    if "zero3_nvme" in args.configs and "REPLACE" in (ROOT / "ds_configs/zero3_nvme.json").read_text():
        parser.error("zero3_nvme.json still holds its placeholder nvme_path; set it to a fast local NVMe folder first")
    try:  # the report folder, before the runs whose results it is to hold
        check_report_dir(args.out_dir, "--out_dir")
    except ReportFolderError as error:
        parser.error(str(error))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm.auto import tqdm

    has_cuda = torch.cuda.is_available()
    if args.find_max and not (has_cuda and args.memory_budget):
        print(
            "error: --find_max searches the largest preset that fits a CUDA memory budget: it needs a GPU and "
            "--memory_budget (on a CPU every preset up to xl would just run, for hours)",
            file=sys.stderr,
        )
        return 2
    args.has_cuda = has_cuda
    args.mixed_precision = args.loop[2].mixed_precision or ("bf16" if has_cuda else "no")
    report_dir = claim_report_folder(args.out_dir, "zero_compare")  # zero_compare_<time>[_NN]: this invocation's
    rows = []
    presets = [args.loop[0].preset] if not args.find_max else PRESET_ORDER[PRESET_ORDER.index(args.find_max_from) :]
    jobs = [(c, p) for c in args.configs for p in presets]
    bar = tqdm(total=len(jobs), desc="zero-compare", unit="run")
    for i, config in enumerate(args.configs):
        best = None
        for preset in presets:
            bar.set_postfix_str(f"{config} {preset}")
            row = measure(args, config, preset, report_dir, args.port + i)
            bar.update(1)
            if row["status"] == "skipped":
                tqdm.write(f"{config} {preset}: {row['error']}", file=sys.stderr)
            if not args.find_max:
                rows.append(row)
            elif row["status"] == "ok":
                best = row
            else:
                bar.update(len(presets) - presets.index(preset) - 1)
                if row["status"] == "skipped":  # the row that completed says where the walk stopped, and why
                    best = {**best, "note": f"{preset} skipped: {row['error']}"} if best else row
                break  # larger presets need more memory
        if args.find_max:
            rows.append(best or {"config": config, "preset": "—", "status": "failed", "error": "nothing fits"})
    bar.close()

    csv_path, md_path, png_path = (report_dir.with_name(f"{report_dir.name}.{ext}") for ext in ("csv", "md", "png"))
    markdown = format_markdown(rows, args, has_cuda)
    with written_whole([csv_path, md_path, png_path], f"the report {report_dir.name}.*"):
        with csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        md_path.write_text(markdown + "\n")
        plot(rows, png_path, has_cuda)
    print(markdown)
    print(f"\nwrote {csv_path}, {md_path}, {png_path} (run logs in {report_dir})")
    return 0


if __name__ == "__main__":
    from concept_encoder.common.entry import run_tool

    sys.exit(run_tool(main, "launch/zero_compare.py"))
