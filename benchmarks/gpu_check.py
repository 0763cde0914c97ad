"""One GPU check, for anyone lent a single GPU for ten minutes: `make gpu-check`.

    python benchmarks/gpu_check.py                      # on a CUDA machine: the parts below, ten minutes
    python benchmarks/gpu_check.py --dry                # anywhere: a tiny version of every part (CI runs it)
    python benchmarks/gpu_check.py --peak_tflops 312    # MFU against your own peak (default: looked up)

Parts, most valuable first, each in its own process with its own time limit (`TIME_LIMITS_S`, ten minutes in
all on an H100-class GPU); a part that fails, cannot run (a package missing: it says which) or runs out of time is
reported and the next one runs; a part out of time is ended with every process it started (`timed_part.py`):

1. `loop`: `loops/mlm.py` on the `base` preset with bf16 through `accelerate launch`, N = 512: tokens/s,
   achieved TFLOP/s (analytic matmul FLOPs, `concept_encoder/accounting/flops.py`) and MFU against the GPU's
   peak bf16 dense TFLOP/s, looked up from the device name (`PEAK_BF16_TFLOPS`) or `--peak_tflops`.
2. `bert`: `benchmarks/scaling.py`: the Concept Encoder's training step beside BERT of the same shape (SDPA) at
   N = 512 and 4,096, interleaved in one process, so the speed ratio is measured in one run.
3. `probe`: the loop's attention-kernel probe for `base` under bf16: which kernels may run (flash?).
4. `syncs`: host-device syncs per micro-batch and per optimizer step (`HOST_SYNCS_HOOK`, issue #53 item 1).
5. `compile`: `benchmarks/compile_speed.py` on `base` with bf16: compiled / eager step time, compile time,
   recompiles after warm-up.
6. `zero`: DeepSpeed's CPU Adam built once (`launch/build_ops.py`), then `launch/zero_compare.py`, one run
   each, under a 10 GB cap (micro-batch 4, N = 512): `xl` (1B) under `zero2_offload` and `zero3_offload`, then
   `3b` under `zero3_offload` (where time is left; zero_compare skips a preset the host lacks the RAM for).

Every part's entry holds the peak host RSS of its process tree; `summary.json` and `summary.md` under `--out` are
rewritten as each part (and each zero run) finishes, so a check cut short keeps what it measured. Without CUDA (or
with `--dry`) every part runs at toy size on the CPU (micro preset, a few steps, compile traced by dynamo with the
`eager` backend, the ZeRO runs at micro without the cap): the plumbing is checked and each GPU number is marked
unavailable, never invented.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_parts  # noqa: E402
from benchmarks.gpu_parts import HOST_SYNCS_HOOK, PART_NEEDS, PARTS  # noqa: E402
from benchmarks.timed_part import error_line, run_part  # noqa: E402
from concept_encoder.common.report_files import claim_report_folder  # noqa: E402

# Dense bf16 tensor-core peak per GPU (vendor data sheets, no sparsity), by a name fragment; first match wins.
PEAK_BF16_TFLOPS = [
    ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("GH200", 989.0), ("B200", 2250.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0),
    ("A10", 125.0), ("RTX 4090", 165.0), ("RTX 3090", 71.0), ("RTX 3080", 59.5), ("A6000", 155.0),
]  # fmt: skip
# Seconds per part on an H100-class GPU, 600 in all (`--budget_s`); estimates from the CPU runs and the models'
# FLOPs, until a GPU run measures them. A part gets its limit or what is left of the budget, whichever is less;
# the last part (zero) gets all that is left: its share, and whatever the parts before it did not use.
TIME_LIMITS_S = {
    "loop": 100,  # launch, imports and tokenizer ~20 s, `base` built, 30 bf16 steps (ms each), final save and check
    "bert": 70,  # four base-shape models built once; 1 + 5 interleaved steps each at N = 512 and 4,096 (~1 s a round)
    "probe": 25,  # one process: imports, a few attention calls
    "syncs": 25,  # one process: each loop's step counted over one and two micro-batches
    "compile": 120,  # inductor's first compile of a base step's forward and backward dominates
    "zero": 260,  # CPU Adam's build (~40 s), two xl runs (<= 110 s each: 1B fp32 built on the host, offload set up)
}
BUDGET_S = sum(TIME_LIMITS_S.values())
MIN_PART_S = 10  # less than this left of the budget: the part is skipped


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named `device_name`, or None when it is not in the table."""
    return next((peak for fragment, peak in PEAK_BF16_TFLOPS if fragment.lower() in device_name.lower()), None)


def missing_modules(part: str) -> list[str]:
    """The packages `part` needs that this Python lacks (the GPU image has no DeepSpeed and no datasets)."""
    return [name for name in PART_NEEDS[part] if importlib.util.find_spec(name) is None]


def cannot_run(part: str) -> str | None:
    """Why `part` cannot run here, in one line, or None."""
    if missing := missing_modules(part):
        return (f"needs {', '.join(missing)}, which this Python ({sys.executable}) lacks: build the wheels with "
                "`make gpu-kit` where pip works and install them here (docs/scaling.md, `make gpu-check`)")  # fmt: skip
    if part == "syncs":
        module, name = HOST_SYNCS_HOOK
        if importlib.util.find_spec(module) is None or not hasattr(importlib.import_module(module), name):
            return f"not counted yet: {module} has no {name}(preset, device, precision) (issue #53 item 1)"
    return None


def run_single(command: list[str], read, limit_s: float, work: Path) -> dict:
    """Run a one-command part; its entry: status, seconds, host RSS peak, and its result or why it has none."""
    outcome = run_part(command, limit_s, cwd=work)
    entry = {"status": "failed", "seconds": round(outcome.seconds, 1), "host_rss_peak_gb": outcome.host_rss_peak_gb,
             "command": command}  # fmt: skip
    if outcome.code is None:
        entry.update(status="timed out", error=f"ran past its {limit_s:.0f} s limit", output_tail=outcome.output)
    elif outcome.code != 0:
        entry.update(
            error=f"exit {outcome.code}: {error_line(outcome.output)}".rstrip(": "), output_tail=outcome.output
        )
    else:
        try:
            entry.update(status="ok", result=read(outcome.output))
        except (OSError, ValueError, KeyError, IndexError) as error:
            entry.update(error=f"could not read the result: {error!r}", output_tail=outcome.output)
    return entry


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


def run_syncs_only(preset: str, device: str, precision: str) -> int:
    """`--syncs_only`: the counts of `HOST_SYNCS_HOOK` for `preset`'s training steps; prints one JSON line."""
    module, name = HOST_SYNCS_HOOK
    counts = getattr(importlib.import_module(module), name)(preset, device, precision)
    print(json.dumps({**counts, "preset": preset, "device": device, "precision": precision}, default=str))
    return 0


def markdown(summary: dict) -> str:
    lines = [f"# GPU check · {summary['device']} · {summary['started']}", ""]
    if not summary["cuda"]:
        lines += ["No CUDA device: every part ran its toy-sized `--dry` version on the CPU; "
                  "the GPU numbers are unavailable.", ""]  # fmt: skip
    lines += ["| part | status | seconds | host RSS peak | result |", "|---|---|---|---|---|"]
    for part in PARTS:
        entry = summary["parts"].get(part, {"status": "pending", "seconds": 0})
        rss = f"{entry['host_rss_peak_gb']:.1f} GB" if entry.get("host_rss_peak_gb") else "—"
        said = [gpu_parts.describe(part, entry)] if "result" in entry else []  # a zero part cut short: its runs
        text = "; ".join(said + ([entry["error"]] if entry.get("error") else []))
        lines.append(f"| {part} | {entry['status']} | {entry['seconds']:.0f} | {rss} | {text} |")
    return "\n".join(lines)


def write_summary(work: Path, summary: dict) -> str:
    """`summary.json` and `summary.md` as they stand: written after every part and every ZeRO run."""
    text = markdown(summary)
    (work / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (work / "summary.md").write_text(text + "\n")
    return text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry", action="store_true", help="toy-sized parts on the CPU (automatic without CUDA)")
    parser.add_argument("--peak_tflops", type=float, default=None, help="the GPU's peak for MFU (default: looked up)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    parser.add_argument("--budget_s", type=float, default=BUDGET_S, help="time for all parts together")
    parser.add_argument("--out", default=None, help="output folder (default Cache/reports/gpu_check_<time>)")
    parser.add_argument("--probe_only", nargs=2, metavar=("PRESET", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--syncs_only", nargs=3, metavar=("PRESET", "DEVICE", "PRECISION"), help=argparse.SUPPRESS)
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
    if args.syncs_only:
        return run_syncs_only(*args.syncs_only)
    import torch

    cuda = torch.cuda.is_available() and not args.dry
    device_name = (
        torch.cuda.get_device_name() if cuda else "CPU (no CUDA)" if not torch.cuda.is_available() else "CPU (--dry)"
    )
    peak = args.peak_tflops or (peak_tflops(device_name) if cuda else None)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    work = Path(args.out).resolve() if args.out else claim_report_folder("Cache/reports", "gpu_check")
    work.mkdir(parents=True, exist_ok=True)
    settings = gpu_parts.part_settings(dry=not cuda)
    summary = {"device": device_name, "cuda": cuda, "peak_bf16_tflops": peak, "started": stamp,
               "budget_s": args.budget_s, "time_limits_s": TIME_LIMITS_S, "settings": settings,
               "host_syncs_per_micro_batch": None, "host_syncs_per_optimizer_step": None, "parts": {}}  # fmt: skip
    deadline = time.perf_counter() + args.budget_s
    for part in PARTS:
        left = deadline - time.perf_counter()
        if part not in args.parts:
            entry = {"status": "skipped", "seconds": 0, "error": "not in --parts"}
        elif left < MIN_PART_S:
            entry = {"status": "skipped", "seconds": 0, "error": f"the {args.budget_s:.0f} s budget was spent"}
        elif reason := cannot_run(part):
            entry = {"status": "cannot run", "seconds": 0, "error": reason}
        else:
            limit = left if part == PARTS[-1] else min(TIME_LIMITS_S[part], left)  # the last: what the rest left
            print(f"gpu-check: {part} (limit {limit:.0f} s) ...", file=sys.stderr, flush=True)
            if part == "zero":  # several runs, each in the summary as it finishes
                entry = summary["parts"][part] = {}
                gpu_parts.run_zero(settings, work, cuda, limit, entry, lambda: write_summary(work, summary))
            else:
                command, read = gpu_parts.BUILDERS[part](settings, work, peak)
                entry = run_single(command, read, limit, work)
        if entry["status"] == "ok" and not cuda:
            entry["gpu_numbers"] = "unavailable: no CUDA, toy-sized run on the CPU"
        summary["parts"][part] = entry
        if part == "syncs" and entry["status"] == "ok":
            for key in ("host_syncs_per_micro_batch", "host_syncs_per_optimizer_step"):
                summary[key] = entry["result"].get(key)
        write_summary(work, summary)
    print(write_summary(work, summary))
    print(f"\nwrote {work / 'summary.json'} and {work / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
