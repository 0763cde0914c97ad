"""Sparse vs dense MLM decoding: peak memory and time of the loss, forward + backward.

    python benchmarks/decode_memory.py                      # CPU: tiny shape, vocab 30k and 50k
    python benchmarks/decode_memory.py --full --json out.json

`sparse`: `ConceptEncoderForMaskedLM(input_ids, labels=..., return_logits=False)`, as the training loop
calls it: decoder, LM head and cross-entropy run only at the labelled positions (15%), and the loss is
computed without keeping the `[L,V]` logits (`concept_encoder.model.vocab_projection`).
`sparse_logits`: the same with the sparse logits returned (the default call, `cross_entropy` on them).
`dense`: the same model decoding every position to `[B,N,V]` logits (`model(input_ids).logits`) and
cross-entropy with `ignore_index=IGNORE_INDEX`, as a full-vocabulary head does. Same weights, same labels;
the three losses are equal (checked). Peak memory of one forward + backward is measured in a fresh
subprocess per variant; time is the median of interleaved repeats.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    configure_timing_process,
    device,
    in_subprocess,
    interleaved_medians,
    machine,
    peak_memory_of,
    print_and_save,
)
from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset  # noqa: E402
from concept_encoder.model.constants import IGNORE_INDEX  # noqa: E402

MASK_RATE = 0.15


def setup(preset: str, vocab: int, batch_size: int, seq_len: int):
    torch.manual_seed(0)
    dev = device()
    model = ConceptEncoderForMaskedLM(
        config_from_preset(preset, vocab_size=vocab, max_position_embeddings=max(512, seq_len), hidden_dropout_prob=0.0)
    ).to(dev)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (batch_size, seq_len), generator=g)
    labels = torch.where(torch.rand(batch_size, seq_len, generator=g) < MASK_RATE, ids, IGNORE_INDEX)
    return model, ids.to(dev), labels.to(dev)


VARIANTS = ("sparse", "sparse_logits", "dense")


def loss_fn(variant: str, model, ids, labels):
    def dense():
        logits = model(ids).logits  # [B,N,V]
        return F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX
        )

    def sparse():
        return model(ids, labels=labels, return_logits=variant == "sparse_logits").loss

    fn = dense if variant == "dense" else sparse

    def step():
        model.zero_grad(set_to_none=True)
        fn().backward()

    return fn, step


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="GPU sizes: base shape, batch 16, seq 512")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--vocab_sizes", default="30522,50265")
    parser.add_argument("--batch_size", type=int, default=None)
    parser.add_argument("--seq_len", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--measure", nargs=2, metavar=("VARIANT", "VOCAB"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.preset = args.preset or ("base" if args.full else "tiny")
    args.batch_size = args.batch_size or (16 if args.full else 8)
    args.seq_len = args.seq_len or 512
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.measure:
        variant, vocab = args.measure[0], int(args.measure[1])
        model, ids, labels = setup(args.preset, vocab, args.batch_size, args.seq_len)
        _, step = loss_fn(variant, model, ids, labels)
        step()  # allocate gradients once, so the peak is that of a steady step
        print(json.dumps({"peak_gb": peak_memory_of(step)}))
        return 0
    configure_timing_process()
    rows = []
    for vocab in (int(v) for v in args.vocab_sizes.split(",")):
        model, ids, labels = setup(args.preset, vocab, args.batch_size, args.seq_len)
        losses, steps = zip(*(loss_fn(v, model, ids, labels) for v in VARIANTS), strict=True)
        with torch.no_grad():
            for loss in losses[:-1]:
                torch.testing.assert_close(loss(), losses[-1](), rtol=1e-4, atol=1e-4)
        times = interleaved_medians(dict(zip(VARIANTS, steps, strict=True)), repeats=args.repeats)
        common = ["--preset", args.preset, "--batch_size", str(args.batch_size), "--seq_len", str(args.seq_len)]
        peaks = {v: in_subprocess(Path(__file__), "--measure", v, str(vocab), *common)["peak_gb"] for v in VARIANTS}
        rows.append(
            {
                "vocab": vocab,
                "masked_positions": int(labels.ne(IGNORE_INDEX).sum()),
                **{f"{v}_peak_gb": peaks[v] for v in VARIANTS},
                "peak_ratio": peaks["sparse"] / peaks["dense"],
                "sparse_logits_peak_ratio": peaks["sparse_logits"] / peaks["dense"],
                **{f"{v}_s": times[v] for v in VARIANTS},
                "speedup": times["dense"] / times["sparse"],
            }
        )
    print_and_save(f"Sparse vs dense MLM decoding · {machine()} · preset {args.preset} · batch {args.batch_size} × "
                   f"seq {args.seq_len} · {MASK_RATE:.0%} masked · forward + backward", rows, args)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
