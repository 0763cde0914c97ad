"""The parts of `benchmarks/gpu_check.py`: each part's command at GPU or `--dry` size, how its result is read, and
how it is described in one line; the `zero` part's runs one `launch/zero_compare.py` invocation each, so that
every finished run is in the summary however the part ends."""

from __future__ import annotations

import csv
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.timed_part import Outcome, error_line, run_part

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("loop", "bert", "probe", "syncs", "compile", "zero")  # most valuable first
# What each part imports beyond torch; a part whose package is missing says so instead of failing mid-run (a bare
# GPU image has torch, transformers and accelerate, no DeepSpeed and no datasets: `make gpu-kit` builds them).
PART_NEEDS = {
    "loop": ("accelerate", "datasets"), "bert": ("transformers", "matplotlib"), "probe": ("accelerate",),
    "syncs": (), "compile": ("transformers",), "zero": ("accelerate", "deepspeed", "datasets", "matplotlib"),
}  # fmt: skip
# Issue #53 item 1's counts: `(module, function)`, the function called as `function(preset, device, precision)` ->
# {"host_syncs_per_micro_batch": int, "host_syncs_per_optimizer_step": int, "loops": ...} for each loop's real
# training step (pretraining, the BERT twin, fine-tuning; `benchmarks/host_syncs.py`); gpu_check copies both numbers
# to the top of summary.json (the part says "not counted" if the module lacks the function).
HOST_SYNCS_HOOK = ("benchmarks.host_syncs", "measure_host_syncs")
# The ZeRO runs, in order: xl (1B) under both offload configs, then 3b under ZeRO-3 offload only (ZeRO-2 keeps the
# bf16 parameters and gradients on the GPU: 4 bytes x 3.05B = 11.4 GiB, over the cap before any activation). The
# dry run's one run checks the plumbing (zero_compare's csv, read back); tests/test_deepspeed.py runs both configs.
ZERO_RUNS = {True: (("zero2_offload", "xl"), ("zero3_offload", "xl"), ("zero3_offload", "3b")),
             False: (("zero3_offload", "micro"),)}  # fmt: skip
ZERO_RUN_LIMITS_S = {"xl": 110, "3b": 200, "micro": 120}  # one launch, from start to its final save
BUILD_OPS_LIMIT_S = 60  # CPU Adam with g++ on the GPU machine's cores, once (launch/build_ops.py)
MIN_RUN_S = 20  # less than this left of the part: a run is not started


def part_settings(dry: bool) -> dict:
    """Model size and step counts: the GPU check, or its toy-sized `--dry` twin (compile traced by dynamo alone,
    `eager` backend)."""
    if dry:
        return {"preset": "micro", "seq_len": 64, "batch": 4, "steps": 4, "precision": "no", "backend": "eager",
                "bert_lengths": (64, 128), "vocab_size": 500}  # fmt: skip
    return {"preset": "base", "seq_len": 512, "batch": 16, "steps": 30, "precision": "bf16", "backend": "inductor",
            "bert_lengths": (512, 4096), "vocab_size": 8000}  # fmt: skip


def loop_flags(settings: dict, steps: int) -> list[str]:
    return [
        "--preset", settings["preset"], "--max_seq_length", str(settings["seq_len"]),
        "--per_device_train_batch_size", str(settings["batch"]), "--max_steps", str(steps),
        "--tokenizer", "train:wordpiece:8000", "--report_to", "none", "--progress_bar", "false",
        "--eval_steps", "0", "--save_steps", "0", "--max_eval_batches", "2", "--logging_steps", "5",
    ]  # fmt: skip


def accelerate_launch(*options: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
            "--dynamo_backend", "no", *options]  # fmt: skip


def python(script: str, *args: str) -> list[str]:
    return [sys.executable, str(ROOT / script), *args]


# --- the one-command parts: (settings, work folder, peak TFLOP/s) -> (command, how to read its result) ----------


def loop_part(settings: dict, work: Path, peak: float | None):
    run = "gpu-check-loop"
    precision = settings["precision"]
    command = accelerate_launch("--mixed_precision", precision, str(ROOT / "loops/mlm.py"),
                                *loop_flags(settings, settings["steps"]), "--output_dir", str(work / "runs"),
                                "--run_name", run, *(["--peak_tflops", str(peak)] if peak else []))  # fmt: skip

    def read(output: str) -> dict:
        records = [json.loads(line) for line in (work / "runs" / run / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["kind"] == "train"][1:] or [r for r in records if r["kind"] == "train"]
        median = {k: statistics.median(r[k] for r in train) for k in ("tokens_per_s", "tflops_per_s") if k in train[0]}
        result = {"preset": settings["preset"], "precision": precision, "steps": settings["steps"], **median}
        if peak and "mfu" in train[0]:
            result["mfu"] = statistics.median(r["mfu"] for r in train)
        result["cuda_peak_gb"] = max((r.get("cuda_peak_allocated_gb") or 0 for r in train), default=None) or None
        result["rank_peak_rss_gb"] = max((r.get("peak_rss_gb") or 0 for r in train), default=None) or None
        return result

    return command, read


def bert_part(settings: dict, work: Path, peak: float | None):
    out = work / "bert.json"
    precision = "bf16" if settings["precision"] == "bf16" else "fp32"
    command = python("benchmarks/scaling.py", "--preset", settings["preset"],
                     "--lengths", ",".join(map(str, settings["bert_lengths"])), "--batch_size", str(settings["batch"]),
                     "--vocab_size", str(settings["vocab_size"]), "--precision", precision,
                     "--repeats", "5" if precision == "bf16" else "1", "--no_memory", "--json", str(out),
                     "--plot", str(work / "bert.png"))  # fmt: skip
    keys = ("concept_tokens_per_s", "concept_kv_tokens_per_s", "bert_sparse_tokens_per_s", "bert_tokens_per_s",
            "concept_speedup_vs_bert_sparse", "concept_kv_speedup_vs_bert_sparse", "concept_speedup_vs_bert",
            "concept_kv_speedup_vs_bert")  # fmt: skip

    def read(output: str) -> dict:
        report = json.loads(out.read_text())
        rows = [{"N": row["N"], **{k: row[k] for k in keys}} for row in report["rows"]]
        targets = [v for v in report["verdicts"] if v["target"].startswith("speed-up")]
        return {"preset": settings["preset"], "precision": precision, "batch": settings["batch"], "rows": rows,
                "targets": targets}  # fmt: skip

    return command, read


def probe_part(settings: dict, work: Path, peak: float | None):
    command = python("benchmarks/gpu_check.py", "--probe_only", settings["preset"], str(settings["seq_len"]))

    def read(output: str) -> dict:
        verdict = json.loads(output.strip().splitlines()[-1])
        return {**verdict, "flash_eligible": verdict.get("flash", False)}

    return command, read


def syncs_part(settings: dict, work: Path, peak: float | None):
    device = "cpu" if settings["backend"] != "inductor" else "cuda"  # the dry run's, or the GPU's
    command = python("benchmarks/gpu_check.py", "--syncs_only", settings["preset"], device, settings["precision"])
    return command, lambda output: json.loads(output.strip().splitlines()[-1])


def compile_part(settings: dict, work: Path, peak: float | None):
    out = work / "compile.json"
    precision = "bf16" if settings["precision"] == "bf16" else "fp32"
    dry = settings["backend"] != "inductor"
    command = python("benchmarks/compile_speed.py", "--preset", settings["preset"], "--lengths",
                     str(settings["seq_len"]), "--batch_size", str(settings["batch"]), "--precision", precision,
                     "--backend", settings["backend"], "--repeats", "2" if dry else "5", "--json", str(out),
                     *(["--vocab_size", "2000"] if dry else []))  # fmt: skip

    def read(output: str) -> dict:
        [row] = json.loads(out.read_text())["rows"]
        return {"backend": settings["backend"], **row}

    return command, read


BUILDERS = {"loop": loop_part, "bert": bert_part, "probe": probe_part, "syncs": syncs_part, "compile": compile_part}


# --- the zero part: several runs, each written to the summary as it finishes ------------------------------------


def zero_command(settings: dict, work: Path, cuda: bool, config: str, preset: str, limit_s: float, index: int):
    """One `launch/zero_compare.py` run of `preset` under `config`; its own timeout a little inside `limit_s`, so
    that a run out of time is still reported by zero_compare itself."""
    command = python("launch/zero_compare.py", "--configs", config, "--preset", preset,
                     "--out_dir", str(work / "zero" / f"{config}-{preset}"), "--workdir", str(work),
                     "--steps", "2", "--untimed_steps", "1", "--timeout", str(max(10, int(limit_s) - 15)),
                     "--port", str(29720 + 10 * index), "--max_seq_length", str(settings["seq_len"]),
                     "--per_device_train_batch_size", str(4 if cuda else settings["batch"]),
                     "--tokenizer", "train:wordpiece:8000")  # fmt: skip
    return command + (["--memory_budget", "10GB"] if cuda else [])


def zero_row(outcome: Outcome, folder: Path, config: str, preset: str) -> dict:
    """The run's row of zero_compare's csv (numbers as numbers), with its parameter count and the host RSS peak
    of its whole process tree; a run that wrote no csv, with why."""
    row: dict = {"config": config, "preset": preset, "parameters": parameters(preset)}
    written = sorted(folder.glob("zero_compare_*.csv"))[-1:]
    if written:
        with written[0].open() as f:
            row.update({k: number(v) for k, v in next(csv.DictReader(f), {}).items() if v not in (None, "")})
        if "status" not in row:
            row.update(status="failed", error=f"{written[0].name} holds no row")
    elif outcome.code is None:
        row.update(status="timed out", error=f"ran past its limit after {outcome.seconds:.0f} s")
    else:
        row.update(status="failed", error=f"exit {outcome.code}: {error_line(outcome.output) or 'no output'}")
    row.update(seconds=round(outcome.seconds, 1), host_rss_peak_gb=outcome.host_rss_peak_gb)
    return row


def parameters(preset: str) -> int:
    """`preset`'s parameter count at the 8k vocabulary the runs' tokenizer has."""
    from concept_encoder.accounting.memory import model_parameter_count
    from concept_encoder.model.presets import PRESETS

    return model_parameter_count({**PRESETS[preset], "vocab_size": 8000})["total"]


def number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def run_zero(settings: dict, work: Path, cuda: bool, limit_s: float, entry: dict, save) -> dict:
    """The zero part into `entry` (the summary's, so that `save()`, called after each run, writes what finished):
    CPU Adam built (GPU only; `make install` built it elsewhere), then each of `ZERO_RUNS` that time allows: a
    config's first preset with whatever is left, a larger one only with its whole limit left and once the smaller
    one completed. Ok when a run completed; timed out when the part's time ran out (the finished runs kept)."""
    started = time.perf_counter()
    runs: list[dict] = []
    entry.update(status="running", seconds=0)
    left = lambda: limit_s - (time.perf_counter() - started)  # noqa: E731
    if cuda:
        build = run_part(python("launch/build_ops.py"), min(BUILD_OPS_LIMIT_S, left()), cwd=work)
        entry["build_ops"] = {"code": build.code, "seconds": round(build.seconds, 1), "output_tail": build.output}
        if build.code != 0:
            entry.update(status="failed", seconds=round(time.perf_counter() - started, 1), host_rss_peak_gb=0.0,
                         error=f"DeepSpeed's CPU Adam did not build: {build.output.strip()[-300:]}")  # fmt: skip
            return entry
    timed_out = False
    for index, (config, preset) in enumerate(ZERO_RUNS[cuda]):
        smaller = [r for r in runs if r["config"] == config]
        need = ZERO_RUN_LIMITS_S[preset] if smaller else MIN_RUN_S  # a larger preset cut short would measure nothing
        if any(r.get("status") != "ok" for r in smaller) or left() < need:
            why = (f"{smaller[-1]['preset']} did not complete under {config}" if left() >= need
                   else f"needs up to {need} s; {max(left(), 0):.0f} s of the part's time left")  # fmt: skip
            runs.append({"config": config, "preset": preset, "parameters": parameters(preset), "status": "skipped",
                         "error": why})  # fmt: skip
            continue
        limit = min(ZERO_RUN_LIMITS_S[preset], left())
        outcome = run_part(zero_command(settings, work, cuda, config, preset, limit, index), limit, cwd=work)
        runs.append(zero_row(outcome, work / "zero" / f"{config}-{preset}", config, preset))
        timed_out = timed_out or (outcome.code is None and limit < ZERO_RUN_LIMITS_S[preset])
        entry.update(seconds=round(time.perf_counter() - started, 1), result=zero_result(runs, cuda))
        save()
    completed = [r for r in runs if r.get("status") == "ok"]
    entry.update(status="timed out" if timed_out else "ok" if completed else "failed",
                 seconds=round(time.perf_counter() - started, 1), result=zero_result(runs, cuda),
                 host_rss_peak_gb=max((r.get("host_rss_peak_gb") or 0 for r in runs), default=0.0))  # fmt: skip
    if timed_out:
        entry["error"] = f"ran past its {limit_s:.0f} s limit; the runs that finished are kept"
    elif not completed:
        entry["error"] = "no run completed: " + "; ".join(
            f"{r['config']} {r['preset']}: {r.get('error')}" for r in runs
        )
    return entry


def zero_result(runs: list[dict], cuda: bool) -> dict:
    """The runs so far and, per config, the largest preset that completed (with its memory, GPU and host)."""
    largest = {}
    for run in runs:
        if run.get("status") == "ok":
            largest[run["config"]] = run
    return {"memory_budget_gb": 10 if cuda else None, "runs": runs, "largest_that_completes": largest}


# --- one line per part -----------------------------------------------------------------------------------------


def gb(value) -> str:
    return f"{value:.1f} GB" if isinstance(value, int | float) else "—"


def params_text(count) -> str:
    if not count:
        return "?"
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:,.1f}M"


def describe(part: str, entry: dict) -> str:
    """`part`'s result in one line of the summary table (memory verdicts with their host RSS)."""
    r = entry["result"]
    if part == "loop":
        mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") is not None else ", MFU unavailable (no peak)"
        tflops = f", {r['tflops_per_s']:.2f} TFLOP/s" if r.get("tflops_per_s") else ""
        precision = "fp32" if r["precision"] == "no" else r["precision"]
        memory = f"; CUDA peak {gb(r['cuda_peak_gb'])}, host RSS peak {gb(entry.get('host_rss_peak_gb'))}"
        return f"{r['preset']}, {precision}: {r['tokens_per_s']:,.0f} tokens/s{tflops}{mfu}{memory}"
    if part == "bert":
        targets = {t["N"]: f" (target {t['target'].split()[-1]}: {'met' if t['met'] == 'yes' else 'missed'})"
                   for t in r["targets"]}  # fmt: skip
        return "; ".join(f"N={row['N']}: {row['concept_kv_speedup_vs_bert_sparse']:.2f}x BERT (sparse head) with "
                         f"shared K/V{targets.get(row['N'], '')}, {row['concept_speedup_vs_bert_sparse']:.2f}x "
                         f"without, {row['concept_speedup_vs_bert']:.2f}x BertForMaskedLM" for row in r["rows"])  # fmt: skip
    if part == "probe":
        kernels = ", ".join(f"{k}={'yes' if r[k] else 'no'}" for k in ("flash", "memory_efficient", "cudnn", "math"))
        return f"{r['preset']} at N={r['seq_len']}, {r['dtype']}: {kernels}"
    if part == "syncs":
        return (f"{r.get('host_syncs_per_micro_batch')} per micro-batch, {r.get('host_syncs_per_optimizer_step')} "
                "per optimizer step")  # fmt: skip
    if part == "compile":
        return (f"{r['speedup']:.2f}x eager ({r['backend']}), compile {r['compile_s']:.1f} s, "
                f"{r['recompiles_after_warmup']} recompiles after warm-up, {r['graph_breaks']} graph breaks")  # fmt: skip
    cap = f" in {r['memory_budget_gb']} GB" if r["memory_budget_gb"] else ""
    return "; ".join(f"{run['config']} {run['preset']} ({params_text(run.get('parameters'))}){cap}: {run['status']}"
                     + (f", CUDA peak {gb(run.get('cuda_peak_allocated_gb'))}, host RSS peak "
                        f"{gb(run.get('host_rss_peak_gb'))}" if run["status"] == "ok" else f" ({run.get('error')})")
                     for run in r["runs"])  # fmt: skip
