"""Host memory against the number of distinct batch shapes a CPU training process has seen, with and without the
local mixer, with batch lengths as they come and rounded up to a multiple (`--pad_to_multiple_of`).

    python benchmarks/shape_memory.py                         # micro, batch 32, 60 lengths from 500 to 2,000
    python benchmarks/shape_memory.py --shapes 150 --json out.json

Why: ListOps' full task fine-tuned with the mixer held twice the peak RSS of the same run without it (5.73 GB
against 2.89, docs/results.md), which the convolution's activations (tens of MB) do not explain. Each
configuration runs in a fresh process under the loops' CPU set-up (`configure_cpu_runtime`: freed memory kept
for reuse), steps a `micro` classifier (forward, backward) on one batch of each length, and reports the RSS it
grew by: after the first step (one shape) and after the last (every shape). Lengths are bucketed ListOps' kind:
random, distinct; rounded, they collapse into a few shapes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import in_subprocess, machine, print_and_save  # noqa: E402
from concept_encoder import ConceptEncoderForSequenceClassification, config_from_preset  # noqa: E402
from concept_encoder.common.padding import padded_length  # noqa: E402

MIXERS = ("none", "conv")


def rss_gb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def lengths_of(shapes: int, low: int, high: int, multiple: int | None) -> list[int]:
    """`shapes` distinct lengths drawn from [low, high] (seed 0); rounded up to `multiple` when given."""
    drawn = random.Random(0).sample(range(low, high + 1), shapes)
    return [padded_length(n, multiple) for n in drawn]


def measure(args) -> dict:
    """One configuration, in this (fresh) process: the RSS grown after one shape and after all of them."""
    from concept_encoder.training.runtime import configure_cpu_runtime

    configure_cpu_runtime()  # as the loops run: threads, freed memory kept for reuse
    torch.manual_seed(0)
    config = config_from_preset(args.preset, vocab_size=64, max_position_embeddings=args.high + args.multiple,
                                local_mixer=args.mixer, num_labels=10, classifier_pooling="mean")  # fmt: skip
    model = ConceptEncoderForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lengths = lengths_of(args.shapes, args.low, args.high, args.multiple or None)
    start, grown = rss_gb(), []
    for n in lengths:
        ids = torch.randint(5, 64, (args.batch_size, n))  # [B,N]
        loss = model(
            input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.zeros(args.batch_size, dtype=torch.long)
        ).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        grown.append(rss_gb() - start)
    return {"mixer": args.mixer, "pad_to_multiple_of": args.multiple or None, "shapes": len(set(lengths)),
            "after_one_shape_gb": grown[0], "after_all_gb": grown[-1], "max_gb": max(grown)}  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="micro")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--shapes", type=int, default=60, help="distinct lengths drawn")
    parser.add_argument("--low", type=int, default=500)
    parser.add_argument("--high", type=int, default=2000)
    parser.add_argument("--multiples", default="0,64", help="pad-to multiples compared (0: as drawn)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--measure", nargs=2, metavar=("MIXER", "MULTIPLE"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.measure:
        args.mixer, args.multiple = args.measure[0], int(args.measure[1])
        print(json.dumps(measure(args)))
        return 0
    common = ["--preset", args.preset, "--batch_size", str(args.batch_size), "--shapes", str(args.shapes),
              "--low", str(args.low), "--high", str(args.high)]  # fmt: skip
    multiples = [int(m) for m in args.multiples.split(",")]
    rows = [in_subprocess(Path(__file__), "--measure", mixer, str(m), *common)
            for m in multiples for mixer in MIXERS]  # fmt: skip
    print_and_save(f"RSS grown by distinct batch shapes · {machine()} · {args.preset}, batch {args.batch_size}, "
                   f"{args.shapes} lengths in [{args.low}, {args.high}] · loops' CPU set-up", rows, args)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
