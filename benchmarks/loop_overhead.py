"""Loop overhead: tokens/s of `loops/mlm.py` as launched for real against a bare training loop.

    python benchmarks/loop_overhead.py                 # CPU: small preset, batch 16 × 128
    python benchmarks/loop_overhead.py --full --json out.json

`loop`: `accelerate launch loops/mlm.py` (one process, logging every `--warmup_steps` steps so only
one record falls in the timed window, evaluation only after it, no checkpoints, no W&B); its
tokens/s comes from the `metrics.jsonl` record covering the steps after warm-up.
`bare`: the same model (same seed), the same packed data, collator and batches, the same precision,
in a plain `for batch in loader: loss.backward(); optimizer.step()` loop with no accelerate, no
clipping, scheduler, logging or synchronisation. The ratio loop/bare is the loop's efficiency.
Runs alternate (bare, loop, bare, loop, ...) and the median of each is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    configure_timing_process,
    machine,
    markdown_table,
    synchronize,
    write_json,
)
from concept_encoder.common import process_group  # noqa: E402
from concept_encoder.training.args import parse_args as parse_loop_args  # noqa: E402
from concept_encoder.training.plan import LOOP_SCRIPT, PYTHON_ACCELERATE_LAUNCH, launch_command  # noqa: E402


def loop_arguments(args, run_name: str, workdir: Path) -> tuple:
    """The loop's parsed arguments for this benchmark (model, data, training): one source for both sides."""
    return parse_loop_args([
        "--preset", args.preset, "--per_device_train_batch_size", str(args.batch_size),
        "--max_seq_length", str(args.seq_len), "--tokenizer", args.tokenizer, "--run_name", run_name,
        "--max_steps", str(args.warmup_steps + args.steps), "--logging_steps", str(args.warmup_steps),
        "--eval_steps", "0", "--max_eval_batches", "1", "--save_steps", "0", "--report_to", "none",
        "--progress_bar", "false", "--output_dir", str(workdir / "runs"), "--seed", str(args.seed),
    ])  # fmt: skip


def loop_tokens_per_s(args, workdir: Path) -> float:
    run = f"overhead-{time.time_ns()}"
    accelerate = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd = launch_command(accelerate, *loop_arguments(args, run, workdir), launcher=PYTHON_ACCELERATE_LAUNCH,
                         script=str(ROOT / LOOP_SCRIPT))  # fmt: skip
    out = process_group.run(cmd, 3600, cwd=workdir)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    records = [json.loads(x) for x in (workdir / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    return train[1]["tokens_per_s"]  # the record after warm-up (steps warmup+1 .. warmup+steps)


def bare_tokens_per_s(args, workdir: Path) -> float:
    """The same model, data and batches as the loop, trained by the plainest possible loop."""
    import os

    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    from concept_encoder.data import prepare_data
    from concept_encoder.training.model import build_model

    model_args, data_args, _ = loop_arguments(args, "bare", workdir)
    cwd = os.getcwd()
    os.chdir(workdir)  # same Cache/ (tokenizer, packed data) as the loop runs
    try:
        set_seed(args.seed)
        data = prepare_data(data_args, cache_dir="Cache", seed=args.seed)
    finally:
        os.chdir(cwd)
    model = build_model(model_args, data_args, data.tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01, fused=True)  # as the loop's
    loader = DataLoader(
        data.train,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=data.collator,
        generator=torch.Generator().manual_seed(args.seed),
    )
    model.train()
    tokens, started = 0, None
    batches = iter(loader)
    for step in range(args.warmup_steps + args.steps):
        if step == args.warmup_steps:
            synchronize()
            started = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        model(**batch, return_logits=False).loss.backward()  # the loss as the loop computes it
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup_steps:
            tokens += int(batch["attention_mask"].sum())
    synchronize()
    return tokens / (time.perf_counter() - started)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="larger run: base preset, batch 32 × 512")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--batch_size", type=int, default=None)
    parser.add_argument("--seq_len", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup_steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokenizer", default="train:wordpiece:8000")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--workdir", default=None, help="where the runs' Cache/ lives (default: a temp folder)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.preset = args.preset or ("base" if args.full else "small")
    args.batch_size = args.batch_size or (32 if args.full else 16)
    args.seq_len = args.seq_len or (512 if args.full else 128)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    configure_timing_process()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        bare, loop = [], []
        for _ in range(args.repeats):
            bare.append(bare_tokens_per_s(args, workdir))
            loop.append(loop_tokens_per_s(args, workdir))
            print(f"bare {bare[-1]:,.0f} tok/s, loop {loop[-1]:,.0f} tok/s", file=sys.stderr)
    row = {
        "bare_tokens_per_s": statistics.median(bare),
        "loop_tokens_per_s": statistics.median(loop),
    }
    row["loop_over_bare"] = row["loop_tokens_per_s"] / row["bare_tokens_per_s"]
    print(f"Loop overhead · {machine()} · preset {args.preset} · batch {args.batch_size} × {args.seq_len} · "
          f"{args.steps} timed steps after {args.warmup_steps} · median of {args.repeats}\n")  # fmt: skip
    print(markdown_table([row], list(row)))
    write_json(args.json, {"machine": machine(), "args": vars(args), "runs": {"bare": bare, "loop": loop}, **row})
    return 0


if __name__ == "__main__":
    sys.exit(main())
