"""`python -m concept_encoder check_health <model folder> [--dataset ... | --text FILE]`: is a saved model healthy?

Loads a `save_pretrained` folder (e.g. `Cache/runs/<run>/final`), fails with exit code 1 if any
parameter is NaN/Inf, then evaluates a few masked validation batches with the loop's own evaluation
(`concept_encoder.training.evaluation`) and prints the concept-health table (effective rank, cosines,
collapsed dimensions) with the masked-token loss and accuracy, beside the unigram baseline (always guess
the text's most frequent token, scored on the same masked positions) and the accuracy as a multiple of it.
`--text FILE` is the held-out language check: every block of any plain-text file (say, English of another
domain than the pretraining corpus; `--text licenses` takes the installed packages' license texts, legal
English, from `concept_encoder.data.licenses`) is evaluated; a ratio below 1x means the model has not yet learned
even the unigram distribution of that text. The metric functions themselves live in
`concept_encoder.concepts.health`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from accelerate import Accelerator
from torch.utils.data import DataLoader

from ..checkpoints.model_folder import ModelFolderError, load_checked
from ..common import json_io
from ..common.cli_types import at_least
from ..concepts.health import format_health_table, health_of
from ..data import DataArguments, DataSourceError, prepare_data
from ..data.sources import source_fingerprint
from ..data.tokenizer import check_tokenizer
from ..model.config import ConceptEncoderConfig
from ..model.constants import POSITION_EXTENSIONS
from ..model.heads import ConceptEncoderForMaskedLM
from ..model.positions import extend_position_tables
from ..tasks.loading import training_texts
from ..training.evaluation import evaluate, most_frequent_token
from ..training.plan import output_file_problem
from ..training.preflight import beyond_positions


def heldout_fingerprint(spec: str) -> str:
    """What a held-out check's result depends on besides the model: the text's content and how it is read (whole,
    in document order); `ablate --heldout` reuses a check only when it is equal."""
    return f"{source_fingerprint(spec, training_texts)}:whole"


def not_a_model_folder(path: Path) -> str | None:
    """Why `path` is not a saved Concept Encoder (no folder, no or unreadable config.json, another model type)."""
    config = path / "config.json"
    hint = "pass a folder written by save_pretrained, such as Cache/runs/<run>/final"
    if not config.is_file():
        return f"{path} holds no config.json; {hint}"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError):
        return f"{config} is not a JSON object; {hint}"
    if model_type != ConceptEncoderConfig.model_type:
        return (
            f"{path} holds a {model_type!r} model, not a Concept Encoder ({ConceptEncoderConfig.model_type!r}); {hint}"
        )
    if not any(
        (path / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    ):
        return f"{path} has a config but no weights (model.safetensors); {hint}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m concept_encoder check_health", description=__doc__)
    parser.add_argument("model", help="a save_pretrained folder, e.g. Cache/runs/<run>/final")
    parser.add_argument("--dataset", default="embedded", help="text to probe with (as for the loop)")
    parser.add_argument("--tokenizer", default=None, help="default: the model folder's own tokenizer")
    parser.add_argument("--max_seq_length", type=at_least(2), default=128)
    parser.add_argument(
        "--extend_positions",
        choices=POSITION_EXTENSIONS,
        default="no",
        help="a --max_seq_length past the model's position table: refused (no), or the table grown by repeating "
        "its trained rows (copy): how the model reads past its trained length",
    )
    parser.add_argument(
        "--text", help="held-out language check: a .txt/.jsonl/.parquet file, or `licenses`, evaluated whole"
    )
    parser.add_argument("--batches", type=at_least(1), default=None, help="default 4, all of it with --text")
    parser.add_argument("--batch_size", type=at_least(1), default=16)
    parser.add_argument("--cache_dir", default="Cache")
    parser.add_argument("--json", help="also write the numbers (and the text's fingerprint) to this JSON file")
    args = parser.parse_args(argv)

    path = Path(args.model)
    problem = not_a_model_folder(path) or (args.json and output_file_problem(args.json, "--json"))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        model = load_checked(ConceptEncoderForMaskedLM, path, whole=True)[0].eval()
    except ModelFolderError as error:  # missing or misshapen tensors, NaN/Inf, a weights file cut short
        print(f"error: {error}", file=sys.stderr)
        return 1
    tokenizer = args.tokenizer or str(path)
    seq_len, trained = args.max_seq_length, model.config.max_position_embeddings
    if seq_len > trained:
        if args.extend_positions == "no":
            print(f"error: {beyond_positions(seq_len, trained)}", file=sys.stderr)
            return 2
        extend_position_tables(model, seq_len)
    try:
        data = prepare_data(
            DataArguments(dataset=args.text or args.dataset, tokenizer=tokenizer, max_seq_length=seq_len),
            cache_dir=args.cache_dir,
            seed=0,
            held_out=bool(args.text),  # the whole file is held out: one split, packed in order
            task_texts=training_texts,  # a mixture's task: sources
        )
        check_tokenizer(data.tokenizer, vocab_size=model.config.vocab_size)  # every id has an embedding row
    except (DataSourceError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    split = data.validation if len(data.validation) else data.train
    batches = args.batches or (None if args.text else 4)
    unigram = most_frequent_token(split, data.tokenizer)
    accelerator = Accelerator()
    loader = DataLoader(split, batch_size=args.batch_size, collate_fn=data.collator.collate)
    result = evaluate(accelerator, model.to(accelerator.device), loader, data.collator, data.collator.state_dict(),
                      max_batches=batches, unigram_id=unigram)  # fmt: skip
    n = len(split) if batches is None else min(len(split), batches * args.batch_size)
    print(f"model {path}  ({sum(p.numel() for p in model.parameters()):,} parameters, all finite)")
    print(
        f"probe {args.text or args.dataset}: {n} examples of {seq_len} tokens, C={model.config.concept_num}, "
        f"H={model.config.hidden_size}"
        + (
            f"; positions past {trained} are copies of the trained ones (--extend_positions copy)"
            if seq_len > trained
            else ""
        )
        + "\n"
    )
    table = {
        **health_of(result),
        "masked_token_loss": result["eval_loss"],
        "masked_token_accuracy": result["eval_accuracy"],
        "unigram_baseline_accuracy": result["eval_unigram_accuracy"],
        "accuracy_over_unigram": result["eval_accuracy_over_unigram"],
    }
    print(format_health_table(table))
    if args.json:
        source = args.text or args.dataset
        record = {
            "model": str(path),
            "text": source,
            "fingerprint": heldout_fingerprint(source),  # what was read, and how: a changed text is rechecked
            "examples": n,
            "max_seq_length": seq_len,
            "trained_positions": trained,
            "masked_tokens": result["eval_masked_tokens"],
            "unigram_token": data.tokenizer.convert_ids_to_tokens(unigram),
            **table,
        }
        Path(args.json).write_text(json_io.dumps(record, indent=2) + "\n")
    print(
        f"\nmasked-token accuracy {result['eval_accuracy']:.4f} against {result['eval_unigram_accuracy']:.4f} for always "
        f"guessing {data.tokenizer.convert_ids_to_tokens(unigram)!r} on the same {result['eval_masked_tokens']:,} "
        f"masked tokens: {result['eval_accuracy_over_unigram']:.2f}x"
    )
    if not math.isfinite(result["eval_loss"]):
        print("error: the masked-token loss is not finite", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from ..common.entry import run_tool

    sys.exit(run_tool(main, "python -m concept_encoder check_health"))
