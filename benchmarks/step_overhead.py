"""Eager step time of two source trees, alternating in one run: the step's overhead before and after a change.

    git archive HEAD | (mkdir -p /tmp/before && tar -x -C /tmp/before)
    python benchmarks/step_overhead.py --before /tmp/before                  # micro and small, CPU
    python benchmarks/step_overhead.py --before /tmp/before --presets small --repeats 7 --json out.json

Each tree runs in a worker process of its own (a package cannot be imported twice in one process), which builds
the pretraining loop's model (a Concept Encoder with the default concept losses, or `--architecture bert`), its
fused AdamW and an `Accelerator`, then times optimizer steps when asked. The workers take turns (before, after,
before, ...; the idle one waits on its pipe), so both see the same machine load, and the ratio after/before of
the medians comes from one run. What is timed: a masked CPU batch handed over as the tree's loop hands it over
(the tree after issue 53: found on the CPU and pinned, `prepare_batch`, `pinned`, then `placed`; before it:
`send_to_device`), and the loop's step on it (`train_step`): the work that differs between the trees, with the
loop's default `--dataloader_num_workers 0` (the hand-over on the loop's thread).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HYPER = {"weight_decay": 0.01, "learning_rate": 5e-4, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8}


def tree_step(device):
    """(the tree's step function, its hand-over of a masked CPU batch to `device`). The tree before issue 53 keeps
    its step in `loops/mlm.py` and has no hand-over of its own: named by string there (tools import no loop)."""
    try:
        from concept_encoder.data.objectives import prepare_batch
        from concept_encoder.training.batches import pinned, placed
        from concept_encoder.training.steps import pretraining_step
    except ImportError:
        from accelerate.utils import send_to_device

        return importlib.import_module("loops.mlm").train_step, lambda batch: send_to_device(batch, device)
    return pretraining_step, lambda batch: placed(pinned(prepare_batch(batch), device), device)


def worker(args) -> int:
    """Serve `run <steps>` lines on stdin with one JSON line of per-step seconds each, for the tree `args.tree`."""
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import torch
    from accelerate import Accelerator

    import concept_encoder
    from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
    from concept_encoder.concepts.weighting import ConceptRegularizedLoss
    from concept_encoder.model.bert_baseline import BertForSparseMaskedLM, bert_config
    from concept_encoder.model.presets import PRESETS
    from concept_encoder.training.args import DEFAULT_RECIPE
    from concept_encoder.training.deepspeed_setup import adamw_class
    from concept_encoder.training.objective import ConceptObjective
    from concept_encoder.training.optim import build_optimizer
    from concept_encoder.training.runtime import configure_cpu_runtime

    assert Path(concept_encoder.__file__).resolve().is_relative_to(Path(args.tree).resolve()), concept_encoder.__file__
    configure_cpu_runtime()
    device = torch.device(args.device)
    step, hand_over = tree_step(device)
    torch.manual_seed(0)
    concept = None
    if args.architecture == "bert":
        model = BertForSparseMaskedLM(
            bert_config({**PRESETS[args.preset], "hidden_dropout_prob": 0.0}, args.vocab_size)
        )
    else:
        config = config_from_preset(args.preset, vocab_size=args.vocab_size, hidden_dropout_prob=0.0)
        model = ConceptEncoderForMaskedLM(config)
        losses = ConceptRegularizedLoss(DEFAULT_RECIPE["concept_losses"].split(","), concept_num=config.concept_num,
                                        hidden_size=config.hidden_size, concept_loss_weight=1.0,
                                        warmup_steps=DEFAULT_RECIPE["concept_loss_warmup_steps"])  # fmt: skip
        concept = ConceptObjective(losses, HYPER["learning_rate"], device)
    accelerator = Accelerator(cpu=device.type == "cpu")
    optimizer = build_optimizer(model, argparse.Namespace(**HYPER), adamw=adamw_class(accelerator))
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    generator = torch.Generator().manual_seed(0)

    def masked_batch() -> dict:
        ids = torch.randint(5, args.vocab_size, (args.batch_size, args.seq_len), generator=generator)
        chosen = torch.rand(ids.shape, generator=generator) < 0.15
        return {"input_ids": torch.where(chosen, 4, ids), "attention_mask": torch.ones_like(ids),
                "labels": torch.where(chosen, ids, -100)}  # fmt: skip

    count = 0
    for line in sys.stdin:
        if not line.startswith("run"):
            break
        seconds = []
        for _ in range(int(line.split()[1])):
            batch = masked_batch()  # masking itself is the same in both trees: not timed
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            step(accelerator, model, optimizer, [hand_over(batch)], 1.0, concept, count)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
            count += 1
        print(json.dumps(seconds), flush=True)
    return 0


class Worker:
    def __init__(self, tree: Path, args, preset: str):
        command = [sys.executable, __file__, "--worker", "--tree", str(tree), "--preset", preset,
                   "--architecture", args.architecture, "--device", args.device, "--batch_size", str(args.batch_size),
                   "--seq_len", str(args.seq_len), "--vocab_size", str(args.vocab_size)]  # fmt: skip
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, steps: int) -> list[float]:
        self.process.stdin.write(f"run {steps}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited with {self.process.wait()}")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def compare(args, preset: str) -> dict:
    """One preset: warm-up steps in each tree, then `repeats` alternating rounds of `steps` steps each."""
    workers = {"before": Worker(Path(args.before), args, preset), "after": Worker(Path(args.after), args, preset)}
    try:
        for worker_ in workers.values():
            worker_.run(args.warmup_steps)
        rounds = {name: [] for name in workers}
        for _ in range(args.repeats):
            for name, worker_ in workers.items():
                rounds[name].append(statistics.median(worker_.run(args.steps)))
    finally:
        for worker_ in workers.values():
            worker_.close()
    before, after = (statistics.median(rounds[name]) for name in ("before", "after"))
    return {"preset": preset, "before_ms": 1e3 * before, "after_ms": 1e3 * after, "after_over_before": after / before,
            "rounds_ms": {name: [1e3 * s for s in values] for name, values in rounds.items()}}  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="the source tree before the change (e.g. git archive HEAD, extracted)")
    parser.add_argument("--after", default=str(ROOT), help="the source tree after it (default: this checkout)")
    parser.add_argument("--presets", default="micro,small")
    parser.add_argument("--architecture", default="concept", choices=("concept", "bert"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--vocab_size", type=int, default=8000, help="the loop benchmark's tokenizer size")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round (their median is the round's)")
    parser.add_argument("--warmup_steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds per tree")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--preset", default="micro", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker and not args.before:
        parser.error("--before is required: the tree to compare against (see the usage above)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import machine, markdown_table, write_json

    rows = [compare(args, preset) for preset in args.presets.split(",")]
    print(f"Step overhead · {machine()} · {args.architecture} · batch {args.batch_size} × {args.seq_len}, vocab "
          f"{args.vocab_size} · median of {args.steps} steps, median of {args.repeats} alternating rounds\n")  # fmt: skip
    columns = ["preset", "before_ms", "after_ms", "after_over_before"]
    print(markdown_table([{k: row[k] for k in columns} for row in rows], columns))
    write_json(args.json, {"machine": machine(), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
