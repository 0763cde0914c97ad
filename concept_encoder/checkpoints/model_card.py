"""The model card (`README.md`) written beside a run's final model: what it is, how it was trained,
how it scored, how its concepts look, and the command that reproduces it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from ..concepts.health import format_health_table, health_of

OBJECTIVE_TEXT = {
    "mlm": "masked-language modelling: {masking} masking of {mlm_probability:.0%} of tokens",
    "diffusion": "masked diffusion: rates t ~ U({t_min}, 1), every chosen token `[MASK]`, weighting {diffusion_weighting}",
    "tsdae": "TSDAE: {deletion_rate:.0%} of tokens deleted, every token reconstructed",
    "distill": "distillation from the teacher `{teacher}`: the pooled student, through a linear projection, learns "
    "its mean-pooled sentence embeddings ({distill_loss}, weight {distill_weight:g}), beside masked-language "
    "modelling of {mlm_probability:.0%} of tokens (weight {mlm_weight:g})",
}


def number(value, spec: str) -> str:
    """`value` formatted by `spec`, or "n/a" where the summary holds no number (JSON null: a non-finite value, such
    as the perplexity of an infinite loss, is written as null)."""
    return "n/a" if value is None else format(value, spec)


def description(model: dict, parameters: int, objective: str) -> list[str]:
    """The card's opening paragraph and loading snippet, for a Concept Encoder or the BERT baseline. The snippet
    advises `trust_remote_code` for the model only, whose code files are the project's own; the tokenizer is data
    (its class is one of transformers'), loaded with the model's config so that transformers neither reads the
    config's code again nor asks to, and a folder's tokenizer code, if any, is not this project's to vouch for."""
    if model.get("model_type") == "bert":
        return [
            f"transformers' `BertForMaskedLM` ({model['num_hidden_layers']} layers of width {model['hidden_size']}, "
            f"{parameters:,} parameters), pretrained ({objective}) by concept-encoder's `loops/mlm.py` as the "
            "baseline for Concept Encoders of the same shape, data and budget.",
            "",
            "```python",
            "from transformers import AutoModelForMaskedLM, AutoTokenizer",
            'model = AutoModelForMaskedLM.from_pretrained("<this folder>")',
            'tokenizer = AutoTokenizer.from_pretrained("<this folder>")',
            "```",
        ]
    return [
        f"A Concept Encoder: {model['concept_num']} learned concepts of width {model['hidden_size']} cross-attend "
        f"to the tokens in {model['num_hidden_layers']} layers ({parameters:,} parameters, "
        f"`{model['decoder_type']}` MLM decoder), pretrained ({objective}) by concept-encoder's `loops/mlm.py`.",
        "",
        "```python",
        "from transformers import AutoModelForMaskedLM, AutoTokenizer",
        'model = AutoModelForMaskedLM.from_pretrained("<this folder>", trust_remote_code=True)  # concept-encoder\'s code',
        'tokenizer = AutoTokenizer.from_pretrained("<this folder>", config=model.config)  # data only: no code runs',
        "```",
        "(`trust_remote_code` runs the modelling files concept-encoder's `save_pretrained` wrote into this folder, and "
        "no other code; with the concept-encoder package installed, `import concept_encoder` makes it unnecessary.)",
    ]


def concept_loss_rows(train: dict) -> list[str]:
    """The concept losses the run added to its objective (the default recipe's, or none), as a table row."""
    losses = train.get("concept_losses")
    if losses in (None, "none", ""):
        return [] if losses is None else ["| concept losses | none |"]
    weighting = train.get("loss_weighting", "fixed")
    weight = f"weight {train.get('concept_loss_weight')}" if weighting == "fixed" else f"{weighting} weighting"
    warmup = train.get("concept_loss_warmup_steps") or 0
    return [
        f"| concept losses | {losses.replace(',', ', ')} ({weight}{f', warmed up over {warmup} steps' if warmup else ''}) |"
    ]


def model_card(
    run_name: str, config: dict, summary: dict, command: list[str], exported_from: Path | None = None
) -> str:
    """Markdown with Hugging Face front matter, from the run's resolved `config` and its `summary`. With
    `exported_from` (a training checkpoint, `python -m concept_encoder export`) `command` is the export's, and the
    card's last section names the checkpoint and that command instead of the training command."""
    model, data, train = config["model_config"], config["data_args"], config["training_args"]
    stats = config.get("data_stats", {}).get("train", {})
    world = config.get("system", {}).get("world_size", 1)
    blocks = f"{stats['examples']:,} training blocks" if isinstance(stats.get("examples"), int) else "blocks"
    batch = train["per_device_train_batch_size"] * train["gradient_accumulation_steps"] * world
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: fill-mask",
        "tags: [concept-encoder, masked-lm]",
        "---",
        "",
        f"# {run_name}",
        "",
        *description(model, config["parameters"]["total"], train.get("objective", "mlm")),
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| data | `{data['dataset']}` (field `{data['text_field']}`), {blocks} of {data['max_seq_length']} tokens |",
        f"| tokenizer | `{data['tokenizer']}` ({model['vocab_size']:,} tokens) |",
        f"| objective | {OBJECTIVE_TEXT[train.get('objective', 'mlm')].format(**train, **data)} |",
        *concept_loss_rows(train),
        f"| steps | {summary.get('steps')} optimizer steps, {summary.get('tokens_seen', 0):,} tokens seen |",
        f"| batch | {batch} sequences per step ({world} process(es)) |",
        f"| optimizer | AdamW, peak learning rate {train['learning_rate']}, {train['lr_scheduler_type']} schedule |",
        f"| precision | {summary.get('mixed_precision') or train['mixed_precision'] or 'as launched'} training; "
        f"weights saved in {summary.get('save_dtype') or train.get('save_dtype', 'float32')} |",
    ]
    if summary.get("eval_loss") is not None:
        lines += [
            "",
            "## Evaluation (validation split, masked tokens)",
            "",
            f"masked-token loss {number(summary['eval_loss'], '.4f')}, perplexity "
            f"{number(summary.get('eval_perplexity'), '.1f')}, accuracy {number(summary.get('eval_accuracy'), '.4f')} "
            f"over {number(summary.get('eval_masked_tokens'), ',')} masked tokens.",
        ]
        if summary.get("eval_unigram_accuracy") is not None:
            lines += [
                "",
                f"Against the unigram baseline (always guess the split's most frequent token, scored on the same "
                f"masked positions: accuracy {summary['eval_unigram_accuracy']:.4f}): "
                f"**{number(summary.get('eval_accuracy_over_unigram'), '.2f')}x**. Below 1x the model has not yet "
                "learned the "
                "unigram distribution of its text.",
            ]
    health = health_of(summary)
    if health:
        lines += ["", "## Concept health (last evaluation)", "", format_health_table(health)]
    if summary.get("divergence"):
        lines += ["", f"**Warning:** the training loss diverged: {json.dumps(summary['divergence'])}."]
    if exported_from is None:
        lines += ["", "## Reproduce", "", "```bash", shlex.join(command), "```", ""]
    else:
        lines += ["", "## Exported from a checkpoint", "",
                  f"The training checkpoint `{exported_from}` (step {summary.get('steps')}), written as this folder by:",
                  "", "```bash", shlex.join(command), "```", ""]  # fmt: skip
    return "\n".join(lines)


def write_model_card(
    final_dir: Path, run_name: str, config: dict, summary: dict, command: list[str], exported_from: Path | None = None
) -> Path:
    path = Path(final_dir) / "README.md"
    path.write_text(model_card(run_name, config, summary, command, exported_from))
    return path
