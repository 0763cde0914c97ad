"""Sequence-length scaling: a full MLM training step of the Concept Encoder against BERT of equal shape.

    python benchmarks/scaling.py                     # CPU grid (small shape, N = 512 … 8192, batch 1)
    python benchmarks/scaling.py --full --json out.json   # GPU grid (base shape, larger batches)
    python benchmarks/scaling.py --profile concept 8192   # torch.profiler table of one model's step
    python benchmarks/scaling.py --bounds                 # analytic FLOP ratio of every preset (no timing)

Models, all with the same hidden size, layers, heads, intermediate size and vocabulary, dropout off:
- `concept`: `ConceptEncoderForMaskedLM` (C concepts, sparse decoding at the masked positions);
- `concept_kv`: the same with `token_kv_sharing="all"` (the tokens' keys/values computed once, read by
  every layer);
- `bert`: `transformers.BertForMaskedLM` as users run it (SDPA attention, full-vocabulary MLM head);
- `bert_sparse`: the same `BertModel` (SDPA) with our sparse masked-position head, so its ratio to
  `concept` isolates the attention architecture from the decoding trick.
A step is forward + backward + AdamW step on the same input ids and masked positions (15%).
Timings are medians of interleaved repeats after warm-up; peak memory is measured per model at
`--memory_lengths` in a fresh subprocess. FLOPs are analytic (matmuls only, ×3 for forward + backward): our latent
layers are counted on C rows, not N.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_step_arguments,
    configure_timing_process,
    device,
    in_subprocess,
    interleaved_medians,
    machine,
    markdown_table,
    peak_memory_of,
    resolve_step_arguments,
    synchronize,
    write_json,
)
from concept_encoder import ConceptEncoderConfig, ConceptEncoderForMaskedLM  # noqa: E402
from concept_encoder.accounting.flops import mlm_training_flops  # noqa: E402
from concept_encoder.model.bert_baseline import bert_config  # noqa: E402
from concept_encoder.model.constants import IGNORE_INDEX  # noqa: E402
from concept_encoder.model.heads import MaskedLMHead  # noqa: E402
from concept_encoder.model.presets import PRESETS  # noqa: E402

MODELS = ("concept", "concept_kv", "bert", "bert_sparse")
CONCEPT_MODELS = ("concept", "concept_kv")  # compared with the sparse-head BERT, each against its FLOP bound
TOKEN_KV_SHARING = {"concept": "none", "concept_kv": "all"}
MASK_RATE = 0.15
SPEEDUP_TARGETS = {512: 1.2, 4096: 6.0, 8192: 12.0}  # over the sparse-head BERT (benchmarks/README.md)
BOUND_FRACTION_TARGET = 0.9  # measured speed-up / FLOP bound, every concept model and N


class BertWithSparseHead(nn.Module):
    """`BertModel` (SDPA) + the Concept Encoder's MLM head applied only at labelled positions."""

    def __init__(self, bert_config, head_config: ConceptEncoderConfig):
        super().__init__()
        from transformers import BertModel

        self.bert = BertModel(bert_config, add_pooling_layer=False)
        self.head = MaskedLMHead(head_config)
        self.head.decoder.weight = self.bert.embeddings.word_embeddings.weight  # tied, like ours

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """`input_ids [B,N]`, `labels [B,N]` → mean CE `[]` over the labelled positions."""
        hidden = self.bert(input_ids).last_hidden_state  # [B,N,H]
        keep = labels.ne(IGNORE_INDEX)
        return self.head(hidden[keep], labels[keep]) / keep.sum().clamp(min=1)


def shapes(preset: str, vocab_size: int, max_len: int) -> dict:
    return {**PRESETS[preset], "vocab_size": vocab_size, "max_position_embeddings": max_len}


def build(name: str, shape: dict) -> nn.Module:
    from transformers import BertForMaskedLM

    sharing = TOKEN_KV_SHARING.get(name, "none")  # the BERTs' sparse head only reads the shape
    ours = ConceptEncoderConfig(
        **shape, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, token_kv_sharing=sharing
    )
    if name in CONCEPT_MODELS:
        return ConceptEncoderForMaskedLM(ours)
    bert = bert_config({**shape, "hidden_dropout_prob": 0.0}, shape["vocab_size"], attn_implementation="sdpa")
    if name == "bert":
        return BertForMaskedLM(bert)
    return BertWithSparseHead(bert, ours)


def batch(shape: dict, batch_size: int, seq_len: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(5, shape["vocab_size"], (batch_size, seq_len), generator=g)
    labelled = torch.rand(batch_size, seq_len, generator=g) < MASK_RATE
    labels = torch.where(labelled, ids, IGNORE_INDEX)
    return ids.to(dev), labels.to(dev)


def training_loss(name: str, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each model's MLM loss `[]` as it trains: ours as `loops/mlm.py` calls it (no logits kept)."""
    if name in CONCEPT_MODELS:
        return model(input_ids=ids, labels=labels, return_logits=False).loss
    if name == "bert":
        return model(input_ids=ids, labels=labels).loss
    return model(ids, labels)


def make_step(name: str, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, precision: str):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # the loop's AdamW
    autocast = torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = training_loss(name, model, ids, labels)
        loss.backward()
        optimizer.step()

    return step


def flops_per_step(name: str, shape: dict, batch_size: int, seq_len: int) -> float:
    """Analytic matmul FLOPs of forward + backward (3 × forward) for one step; ours from
    `concept_encoder.accounting.flops` (latent layers on C rows), BERT's in the same accounting."""
    if name in CONCEPT_MODELS:
        return mlm_training_flops({**shape, "token_kv_sharing": TOKEN_KV_SHARING[name]}, batch_size, seq_len, MASK_RATE)
    H, L, V, inner = (shape[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"))
    N, M = seq_len, MASK_RATE * seq_len
    layer = 8 * N * H * H + 4 * N * N * H + 4 * N * H * inner  # QKV+O, attention, 2-matrix FFN
    head = 2 * M * H * H + 2 * M * H * V if name == "bert_sparse" else 2 * N * H * H + 2 * N * H * V
    return 3 * batch_size * (L * layer + head)


def concept_growth(model: nn.Module, shape: dict, args) -> float:
    """Our step(8192) / step(1024), timed interleaved (1024, 8192, 1024, ...) so the ratio of two
    lengths is measured in one run like the ratios between models, not across grid rows."""
    dev = next(model.parameters()).device
    steps = {
        n: make_step("concept", model, *batch(shape, args.batch_size, n, dev), args.precision) for n in (1024, 8192)
    }
    times = interleaved_medians(steps, repeats=args.repeats + 2)
    return times[8192] / times[1024]


def flop_bounds(lengths: list[int], vocab_size: int, batch_size: int) -> list[dict]:
    """Per preset, the analytic FLOP ratio BERT-sparse / ours at each length: the speed-up a step
    reaches when both models run their matmuls at the same rate."""
    rows = []
    for preset in PRESETS:
        shape = shapes(preset, vocab_size, max(lengths))
        for name in CONCEPT_MODELS:
            ratio = {n: flops_per_step("bert_sparse", shape, batch_size, n) / flops_per_step(name, shape, batch_size, n)
                     for n in lengths}  # fmt: skip
            rows.append({"preset": preset, "token_kv_sharing": TOKEN_KV_SHARING[name],
                         **{f"N={n}": f"{r:.2f}x" for n, r in ratio.items()}})  # fmt: skip
    return rows


def profile_step(name: str, shape: dict, batch_size: int, seq_len: int, precision: str, top: int = 25) -> str:
    """torch.profiler's table of one model's training step (after two warm-up steps), by op and input shape."""
    from torch.profiler import ProfilerActivity, profile

    dev = device()
    model = build(name, shape).to(dev)
    step = make_step(name, model, *batch(shape, batch_size, seq_len, dev), precision)
    step(), step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step()
        synchronize()
    sort_by = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages(group_by_input_shape=True).table(
        sort_by=sort_by, row_limit=top, max_name_column_width=40, max_shapes_column_width=60
    )


def measure_memory(name: str, shape: dict, batch_size: int, seq_len: int, precision: str) -> float:
    dev = device()
    model = build(name, shape).to(dev)
    step = make_step(name, model, *batch(shape, batch_size, seq_len, dev), precision)
    step()  # optimizer states exist after the first step
    gc.collect()
    return peak_memory_of(step)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser, lengths="512,1024,2048,4096,8192", repeats=3)
    parser.add_argument("--no_memory", action="store_true", help="skip the per-model peak-memory subprocesses")
    parser.add_argument("--memory_lengths", default="1024,8192", help="lengths whose peak memory is measured")
    parser.add_argument("--json", default=None, help="write results (ratios included) to this path")
    parser.add_argument("--plot", default=str(Path(__file__).with_name("scaling.png")))
    parser.add_argument(
        "--profile",
        nargs=2,
        metavar=("MODEL", "N"),
        help=f"profile one step of MODEL ({', '.join(MODELS)}) at length N",
    )
    parser.add_argument("--bounds", action="store_true", help="print the analytic FLOP ratio of every preset and exit")
    parser.add_argument("--measure", nargs=2, metavar=("MODEL", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    resolve_step_arguments(args)
    args.memory_lengths = [int(n) for n in args.memory_lengths.split(",")]
    return args


def met(ok: bool) -> str:
    return "yes" if ok else "**no**"


def verdicts(rows: list[dict]) -> list[dict]:
    """The targets, met or not: the shared-K/V model's speed-up over the sparse-head BERT at the lengths of
    `SPEEDUP_TARGETS`, and for both concept models at every N their speed-up ≥ 90% of their FLOP bound."""
    checks = []
    for row in rows:
        n = row["N"]
        if n in SPEEDUP_TARGETS:
            measured = row["concept_kv_speedup_vs_bert_sparse"]
            checks.append({"model": "concept_kv", "N": n, "target": f"speed-up ≥ {SPEEDUP_TARGETS[n]}x",
                           "measured": f"{measured:.2f}x", "met": met(measured >= SPEEDUP_TARGETS[n])})  # fmt: skip
        for name in CONCEPT_MODELS:
            fraction = row[f"{name}_of_bound"]
            checks.append({"model": name, "N": n, "target": f"≥ {BOUND_FRACTION_TARGET:.0%} of FLOP bound",
                           "measured": f"{fraction:.0%}", "met": met(fraction >= BOUND_FRACTION_TARGET)})  # fmt: skip
    return checks


def plot(rows: list[dict], path: str) -> None:
    """Left: step time vs N (log-log), all three models. Right: speed-up over the sparse-head BERT,
    measured and at equal FLOP/s (the analytic bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    lengths = [r["N"] for r in rows]
    fig, (times, speedup) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, label in (
        ("concept", "Concept Encoder"),
        ("concept_kv", "Concept Encoder, shared token K/V"),
        ("bert_sparse", "BERT + sparse head"),
        ("bert", "BertForMaskedLM"),
    ):
        times.plot(lengths, [r[f"{name}_step_s"] for r in rows], "o-", label=label)
    times.set_ylabel("training step time (s)")
    times.set_title("MLM training step vs sequence length")
    for name, label, color in (("concept", "per-layer K/V", "C0"), ("concept_kv", "shared K/V", "C1")):
        speedup.plot(lengths, [r[f"{name}_speedup_vs_bert_sparse"] for r in rows], "o-", color=color,
                     label=f"{label}, measured")  # fmt: skip
        speedup.plot(lengths, [r[f"{name}_flop_bound"] for r in rows], "--", color=color,
                     label=f"{label}, FLOP bound")  # fmt: skip
    targets = [(n, t) for n, t in SPEEDUP_TARGETS.items() if n in lengths]
    if targets:
        speedup.plot(*zip(*targets, strict=True), "rx", markersize=9, label="targets")
    speedup.set_ylabel("speed-up over BERT + sparse head")
    speedup.set_title("Concept Encoder speed-up")
    for ax in (times, speedup):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    speedup.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%gx"))
    speedup.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    speedup.set_yticks([1, 2, 4, 6, 8, 12])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = shapes(args.preset, args.vocab_size, max(args.lengths))
    if args.measure:
        name, n = args.measure[0], int(args.measure[1])
        print(json.dumps({"peak_gb": measure_memory(name, shape, args.batch_size, n, args.precision)}))
        return 0
    if args.bounds:
        print(f"Analytic FLOP ratio, BERT + sparse head / Concept Encoder · vocab {args.vocab_size} · "
              f"batch {args.batch_size} (the speed-up at equal FLOP/s)\n")  # fmt: skip
        print(
            markdown_table(
                flop_bounds(args.lengths, args.vocab_size, args.batch_size),
                ["preset", "token_kv_sharing"] + [f"N={n}" for n in args.lengths],
            )
        )
        return 0
    configure_timing_process()
    if args.profile:
        name, n = args.profile[0], int(args.profile[1])
        if name not in MODELS:
            raise SystemExit(f"--profile: unknown model {name!r}; choose one of {', '.join(MODELS)}")
        print(profile_step(name, shape, args.batch_size, n, args.precision))
        return 0
    dev = device()
    torch.manual_seed(0)
    models = {name: build(name, shape).to(dev) for name in MODELS}
    rows = []
    for n in args.lengths:
        ids, labels = batch(shape, args.batch_size, n, dev)
        steps = {name: make_step(name, model, ids, labels, args.precision) for name, model in models.items()}
        times = interleaved_medians(steps, repeats=args.repeats)
        row = {"N": n}
        for name in MODELS:
            row[f"{name}_step_s"] = times[name]
            row[f"{name}_tokens_per_s"] = args.batch_size * n / times[name]
            row[f"{name}_gflops"] = flops_per_step(name, shape, args.batch_size, n) / 1e9
            row[f"{name}_achieved_gflops_per_s"] = row[f"{name}_gflops"] / times[name]
            if not args.no_memory and n in args.memory_lengths:
                result = in_subprocess(Path(__file__), "--measure", name, str(n), "--preset", args.preset,
                                       "--batch_size", str(args.batch_size), "--precision", args.precision,
                                       "--vocab_size", str(args.vocab_size), "--lengths", ",".join(map(str, args.lengths)),
                                       "--memory_lengths", str(n))  # fmt: skip
                row[f"{name}_peak_gb"] = result["peak_gb"]
        for name in CONCEPT_MODELS:
            row[f"{name}_speedup_vs_bert_sparse"] = times["bert_sparse"] / times[name]
            row[f"{name}_flop_bound"] = row["bert_sparse_gflops"] / row[f"{name}_gflops"]
            row[f"{name}_of_bound"] = row[f"{name}_speedup_vs_bert_sparse"] / row[f"{name}_flop_bound"]
            row[f"{name}_speedup_vs_bert"] = times["bert"] / times[name]
        rows.append(row)
        print(
            f"N={n}: "
            + ", ".join(f"{k}={v:.3g}" for k, v in row.items() if k.endswith("step_s") or k.startswith("speedup")),
            file=sys.stderr,
        )
    growth = concept_growth(models["concept"], shape, args) if {1024, 8192} <= set(args.lengths) else None
    columns = ["N", "concept_step_s", "concept_kv_step_s", "bert_sparse_step_s", "bert_step_s",
               "concept_speedup_vs_bert_sparse", "concept_flop_bound", "concept_of_bound",
               "concept_kv_speedup_vs_bert_sparse", "concept_kv_flop_bound", "concept_kv_of_bound",
               "concept_speedup_vs_bert", "concept_kv_speedup_vs_bert",
               "concept_achieved_gflops_per_s", "concept_kv_achieved_gflops_per_s",
               "bert_sparse_achieved_gflops_per_s"]  # fmt: skip
    if not args.no_memory:
        columns += [f"{name}_peak_gb" for name in MODELS]
    print(f"Sequence-length scaling · {machine()} · shape {args.preset} {PRESETS[args.preset]} · vocab "
          f"{args.vocab_size} · batch {args.batch_size} · {args.precision} · median of {args.repeats}\n")  # fmt: skip
    print(markdown_table(rows, columns))
    print("\n" + markdown_table(verdicts(rows), ["model", "N", "target", "measured", "met"]))
    if growth is not None:
        print(f"\nconcept step(8192) / step(1024) = {growth:.2f} (8x the tokens; the two lengths interleaved, "
              f"median of {args.repeats + 2})")  # fmt: skip
    plot(rows, args.plot)
    write_json(
        args.json,
        {"machine": machine(), "args": vars(args), "rows": rows, "verdicts": verdicts(rows),
         "concept_growth_8192_over_1024": growth},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
