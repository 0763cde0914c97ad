"""One GPU check, for anyone lent a single GPU for ten minutes: `make gpu-check`.

    python benchmarks/gpu_check.py                      # on a CUDA machine: the four parts below
    python benchmarks/gpu_check.py --dry                # anywhere: a tiny version of every part (CI runs it)
    python benchmarks/gpu_check.py --peak_tflops 312    # MFU against your own peak (default: looked up)

Parts, each in its own process with its own time limit (a part that fails or runs out of time is
reported and the next one runs; the whole stays under `--budget_s`, 8 minutes by default):

1. `probe`: the loop's attention-kernel probe for the `base` preset under bf16: is flash eligible?
2. `loop`: `loops/mlm.py` on the `base` preset with bf16 through `accelerate launch`: tokens/s,
   achieved TFLOP/s (analytic matmul FLOPs, `concept_encoder/accounting/flops.py`) and MFU against the GPU's
   peak bf16 dense TFLOP/s, looked up from the device name (`PEAK_BF16_TFLOPS`) or `--peak_tflops`.
3. `compile`: `benchmarks/compile_speed.py` on `base` with bf16: compiled / eager step-time ratio,
   compile time, recompiles after warm-up.
4. `zero`: `launch/zero_compare.py --find_max --find_max_from xl --memory_budget 10GB` for
   `zero2_offload` and `zero3_offload` (micro-batch 4, N=512): the largest preset from xl (1B) up that
   completes on a 10 GB slice of the GPU (xl or 3b), with its parameter count at the 8k vocabulary.

Writes `summary.json` and `summary.md` under `--out` and prints the markdown. Without CUDA (or with
`--dry`) every part runs at toy size on the CPU (micro preset, a few steps, compile traced by
dynamo with the `eager` backend, ZeRO-3 offload without `--find_max`): the plumbing is checked and each GPU number is marked
unavailable, never invented.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from concept_encoder.common import process_group  # noqa: E402
from concept_encoder.common.report_files import claim_report_folder  # noqa: E402

# Dense bf16 tensor-core peak per GPU (vendor data sheets, no sparsity), by a name fragment; first match wins.
PEAK_BF16_TFLOPS = [
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("GH200", 989.0), ("B200", 2250.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0),
    ("A10", 125.0), ("RTX 4090", 165.0), ("RTX 3090", 71.0), ("RTX 3080", 59.5), ("A6000", 155.0),
]  # fmt: skip
PARTS = ("probe", "loop", "compile", "zero")
TIME_LIMITS_S = {"probe": 30, "loop": 120, "compile": 100, "zero": 230}  # on an H100-class GPU, 480 s in all


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named `device_name`, or None when it is not in the table."""
    return next((peak for fragment, peak in PEAK_BF16_TFLOPS if fragment.lower() in device_name.lower()), None)


def part_settings(dry: bool) -> dict:
    """Model size and step counts: the GPU check, or its toy-sized `--dry` twin (compile traced by dynamo alone, `eager` backend)."""
    if dry:
        return {"preset": "micro", "seq_len": 64, "batch": 4, "steps": 4, "precision": "no", "backend": "eager"}
    return {"preset": "base", "seq_len": 512, "batch": 16, "steps": 30, "precision": "bf16", "backend": "inductor"}


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


def run_part(command: list[str], limit_s: float, cwd: Path) -> tuple[int | None, str, float]:
    """(exit code or None on timeout, output tail, seconds): the command in its own process group, ended
    whole when it runs past `limit_s`."""
    started = time.perf_counter()
    process = process_group.start(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        code, out, _ = process_group.finish(process, limit_s)
    except subprocess.TimeoutExpired:
        return None, f"ran past its {limit_s:.0f} s limit", time.perf_counter() - started
    return code, (out or "")[-3000:], time.perf_counter() - started


# --- the four parts: each returns (command, how to read its result) -------------------------------------------


def probe_part(settings: dict, work: Path):
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--probe_only",
        settings["preset"],
        str(settings["seq_len"]),
    ]

    def read(output: str) -> dict:
        verdict = json.loads(output.strip().splitlines()[-1])
        return {**verdict, "flash_eligible": verdict.get("flash", False)}

    return command, read


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
        return result

    return command, read


def compile_part(settings: dict, work: Path):
    out = work / "compile.json"
    precision = "bf16" if settings["precision"] == "bf16" else "fp32"
    dry = settings["backend"] != "inductor"
    command = [sys.executable, str(ROOT / "benchmarks/compile_speed.py"), "--preset", settings["preset"],
               "--lengths", str(settings["seq_len"]), "--batch_size", str(settings["batch"]), "--precision", precision,
               "--backend", settings["backend"], "--repeats", "2" if dry else "5", "--json", str(out),
               *(["--vocab_size", "2000"] if dry else [])]  # fmt: skip

    def read(output: str) -> dict:
        [row] = json.loads(out.read_text())["rows"]
        return {"backend": settings["backend"], **row}

    return command, read


def zero_part(settings: dict, work: Path, cuda: bool):
    command = [sys.executable, str(ROOT / "launch/zero_compare.py"), "--configs", "zero2_offload,zero3_offload",
               "--out_dir", str(work / "zero"), "--workdir", str(work), "--steps", "2", "--untimed_steps", "1",
               "--timeout", str(TIME_LIMITS_S["zero"] // 2), "--max_seq_length", str(settings["seq_len"]),
               "--per_device_train_batch_size", str(4 if cuda else settings["batch"]),
               "--tokenizer", "train:wordpiece:8000"]  # fmt: skip
    # from xl (1B) up: the presets below it fit 10 GB with room to spare, and each run costs time
    command += (
        ["--find_max", "--find_max_from", "xl", "--memory_budget", "10GB"] if cuda else ["--preset", settings["preset"]]
    )

    def read(output: str) -> dict:
        [path] = sorted((work / "zero").glob("zero_compare_*.csv"))[-1:]
        import csv

        with path.open() as f:
            rows = list(csv.DictReader(f))
        from concept_encoder.accounting.memory import model_parameter_count
        from concept_encoder.model.presets import PRESETS

        largest = {}
        for row in rows:
            fields = {**PRESETS.get(row["preset"], {}), "vocab_size": 8000}
            params = model_parameter_count(fields)["total"] if row["preset"] in PRESETS else None
            largest[row["config"]] = {"preset": row["preset"], "parameters": params, "status": row["status"],
                                      "cuda_peak_allocated_gb": row.get("cuda_peak_allocated_gb") or None}  # fmt: skip
        return {"memory_budget_gb": 10 if cuda else None, "largest_that_completes": largest}

    return command, read


def run_probe_only(preset: str, seq_len: int) -> int:
    """`--probe_only`: the loop's kernel probe on attention calls of `preset`'s shape; prints one JSON line."""
    import torch
    from accelerate import PartialState

    from concept_encoder import config_from_preset
    from concept_encoder.training.attention_probe import probe_attention_kernels

    config = config_from_preset(preset, vocab_size=8000)
    batch = {"input_ids": torch.zeros(2, seq_len, dtype=torch.long), "attention_mask": torch.ones(2, seq_len)}
    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    verdict = probe_attention_kernels(config, batch, PartialState(), torch.bfloat16 if bf16 else torch.float32)
    print(json.dumps({**verdict, "preset": preset, "seq_len": seq_len}))  # its dtype: bf16, or fp32 on the CPU
    return 0


def describe(part: str, result: dict) -> str:
    if result["status"] != "ok":
        return result.get("error", "")
    r = result["result"]
    if part == "probe":
        kernels = ", ".join(f"{k}={'yes' if r[k] else 'no'}" for k in ("flash", "memory_efficient", "cudnn", "math"))
        return f"{r['preset']} at N={r['seq_len']}, {r['dtype']}: {kernels}"
    if part == "loop":
        mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") is not None else ", MFU unavailable (no peak)"
        tflops = f", {r['tflops_per_s']:.2f} TFLOP/s" if r.get("tflops_per_s") else ""
        precision = "fp32" if r["precision"] == "no" else r["precision"]
        return f"{r['preset']}, {precision}: {r['tokens_per_s']:,.0f} tokens/s{tflops}{mfu}"
    if part == "compile":
        return (f"{r['speedup']:.2f}x eager ({r['backend']}), compile {r['compile_s']:.1f} s, "
                f"{r['recompiles_after_warmup']} recompiles after warm-up, {r['graph_breaks']} graph breaks")  # fmt: skip
    largest = r["largest_that_completes"]
    return "; ".join(f"{config}: {v['preset']} ({params_text(v['parameters'])} parameters, {v['status']})"
                     for config, v in largest.items())  # fmt: skip


def params_text(count: int | None) -> str:
    if not count:
        return "?"
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:,.1f}M"


def markdown(summary: dict) -> str:
    lines = [f"# GPU check · {summary['device']} · {summary['started']}", ""]
    if not summary["cuda"]:
        lines += ["No CUDA device: every part ran its toy-sized `--dry` version on the CPU; "
                  "the GPU numbers are unavailable.", ""]  # fmt: skip
    lines += ["| part | status | seconds | result |", "|---|---|---|---|"]
    for part in PARTS:
        result = summary["parts"][part]
        lines.append(f"| {part} | {result['status']} | {result['seconds']:.0f} | {describe(part, result)} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry", action="store_true", help="toy-sized parts on the CPU (automatic without CUDA)")
    parser.add_argument("--peak_tflops", type=float, default=None, help="the GPU's peak for MFU (default: looked up)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--budget_s", type=float, default=480, help="time for all parts together")
    parser.add_argument("--out", default=None, help="output folder (default Cache/reports/gpu_check_<time>)")
    parser.add_argument("--probe_only", nargs=2, metavar=("PRESET", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.probe_only:
        return run_probe_only(args.probe_only[0], int(args.probe_only[1]))
    import torch

    cuda = torch.cuda.is_available() and not args.dry
    device_name = (
        torch.cuda.get_device_name() if cuda else "CPU (no CUDA)" if not torch.cuda.is_available() else "CPU (--dry)"
    )
    peak = args.peak_tflops or (peak_tflops(device_name) if cuda else None)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    work = Path(args.out).resolve() if args.out else claim_report_folder("Cache/reports", "gpu_check")
    work.mkdir(parents=True, exist_ok=True)
    settings = part_settings(dry=not cuda)
    builders = {
        "probe": lambda: probe_part(settings, work),
        "loop": lambda: loop_part(settings, work, peak),
        "compile": lambda: compile_part(settings, work),
        "zero": lambda: zero_part(settings, work, cuda),
    }
    summary = {"device": device_name, "cuda": cuda, "peak_bf16_tflops": peak, "started": stamp,
               "settings": settings, "parts": {}}  # fmt: skip
    deadline = time.perf_counter() + args.budget_s
    for part in PARTS:
        if part not in args.parts:
            summary["parts"][part] = {"status": "skipped", "seconds": 0, "error": "not in --parts"}
            continue
        left = deadline - time.perf_counter()
        if left < 10:
            summary["parts"][part] = {"status": "skipped", "seconds": 0, "error": "the time budget was spent"}
            continue
        print(f"gpu-check: {part} (limit {min(TIME_LIMITS_S[part], left):.0f} s) ...", file=sys.stderr, flush=True)
        command, read = builders[part]()
        code, output, seconds = run_part(command, min(TIME_LIMITS_S[part], left), cwd=work)
        entry = {"status": "failed", "seconds": round(seconds, 1), "command": command}
        if code is None:
            entry["error"] = output
        elif code != 0:
            entry["error"] = (
                f"exit {code}: " + output.strip().splitlines()[-1][:300] if output.strip() else f"exit {code}"
            )
            entry["output_tail"] = output
        else:
            try:
                entry.update(status="ok", result=read(output))
            except (OSError, ValueError, KeyError, IndexError) as error:
                entry.update(error=f"could not read the result: {error!r}", output_tail=output)
        if entry["status"] == "ok" and not cuda:
            entry["gpu_numbers"] = "unavailable: no CUDA, toy-sized run on the CPU"
        summary["parts"][part] = entry
    text = markdown(summary)
    (work / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (work / "summary.md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {work / 'summary.json'} and {work / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
