"""`torch.compile(dynamic=True)` against eager: a full MLM training step, as `--torch_compile` runs it.

    python benchmarks/compile_speed.py                        # CPU: small shape, N = 512 and 4096, batch 1
    python benchmarks/compile_speed.py --full                 # a GPU: base shape, batch 8, bf16

Two copies of one model (same weights) train on the same batches, each with a different masked count
(so a model that recompiled per count would show it): the compiled one through the loop's own
`maybe_compile`. Reported per N: the compile time (first compiled step minus an eager step), the
median step time of each after warm-up (interleaved, as every ratio in benchmarks/), their ratio, and
the graphs dynamo compiled after warm-up (recompiles; target 0) and its graph breaks. Target
(benchmarks/README.md): compiled ≥ 1.0x eager after warm-up.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_step_arguments,
    configure_timing_process,
    device,
    interleaved_medians,
    machine,
    markdown_table,
    resolve_step_arguments,
    timed,
    write_json,
)
from benchmarks.scaling import MASK_RATE, build, shapes  # noqa: E402
from concept_encoder.model.constants import IGNORE_INDEX  # noqa: E402
from concept_encoder.training.runtime import maybe_compile  # noqa: E402

SPEEDUP_TARGET = 1.0


def varied_batches(shape: dict, batch_size: int, seq_len: int, count: int, dev) -> list[dict]:
    """`count` batches whose masked counts differ (rate `MASK_RATE` ± 40%), the model's keyword inputs."""
    generator = torch.Generator().manual_seed(seq_len)
    batches = []
    for index in range(count):
        rate = MASK_RATE * (0.6 + 0.8 * index / max(count - 1, 1))
        ids = torch.randint(5, shape["vocab_size"], (batch_size, seq_len), generator=generator)
        labels = torch.where(torch.rand(batch_size, seq_len, generator=generator) < rate, ids, IGNORE_INDEX)
        batches.append({"input_ids": ids.to(dev), "labels": labels.to(dev), "return_logits": False})
    return batches


def stepper(model, batches: list[dict], precision: str):
    """A training step (AdamW, as the loop) that moves to the next batch on every call."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    dev_type = batches[0]["input_ids"].device.type
    position = [0]

    def step():
        batch = batches[position[0] % len(batches)]
        position[0] += 1
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()

    return step


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def measure(shape: dict, seq_len: int, args) -> dict:
    dev = device()
    torch.manual_seed(0)
    eager = build("concept", shape).to(dev)
    twin = build("concept", shape).to(dev)
    twin.load_state_dict(eager.state_dict())
    compiled = maybe_compile(twin, True, backend=args.backend)
    batches = varied_batches(shape, args.batch_size, seq_len, args.repeats + args.warmup + 1, dev)
    steps = {"eager": stepper(eager, batches, args.precision), "compiled": stepper(compiled, batches, args.precision)}
    eager_first = timed(steps["eager"])
    compile_s = timed(steps["compiled"]) - eager_first
    for _ in range(args.warmup):  # dynamic=True may trace once more when a size first varies
        steps["compiled"]()
        steps["eager"]()
    graphs, breaks = compiled_graphs(), graph_breaks()
    times = interleaved_medians(steps, repeats=args.repeats, warmup=0)
    return {
        "N": seq_len,
        "eager_step_s": times["eager"],
        "compiled_step_s": times["compiled"],
        "speedup": times["eager"] / times["compiled"],
        "compile_s": compile_s,
        "graphs_compiled": graphs,
        "recompiles_after_warmup": compiled_graphs() - graphs,
        "graph_breaks": breaks,
        "tokens_per_s_compiled": args.batch_size * seq_len / times["compiled"],
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser, lengths="512,4096", repeats=5)
    parser.add_argument("--warmup", type=int, default=2, help="steps of each after the first, not timed")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: trace only, fast)")
    parser.add_argument("--json", default=None, help="write the rows to this path")
    args = parser.parse_args(argv)
    resolve_step_arguments(args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    configure_timing_process()
    shape = shapes(args.preset, args.vocab_size, max(args.lengths))
    rows = []
    for n in args.lengths:
        rows.append(measure(shape, n, args))
        print(f"N={n}: " + ", ".join(f"{k}={v:.3g}" for k, v in rows[-1].items()), file=sys.stderr)
    for row in rows:
        ok = row["speedup"] >= SPEEDUP_TARGET and row["recompiles_after_warmup"] == 0
        row["met"] = "yes" if ok else "**no**"
    print(f"torch.compile(dynamic=True, backend={args.backend}) vs eager · {machine()} · shape {args.preset} · vocab {args.vocab_size} · "
          f"batch {args.batch_size} · {args.precision} · median of {args.repeats}\n")  # fmt: skip
    columns = ["N", "eager_step_s", "compiled_step_s", "speedup", "compile_s", "recompiles_after_warmup",
               "graph_breaks", "met"]  # fmt: skip
    print(markdown_table(rows, columns))
    write_json(args.json, {"machine": machine(), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
