"""Step 7 of the init order: the model the loop trains, fresh from a preset or loaded from a folder."""

from __future__ import annotations

import logging

from ..checkpoints.model_folder import check_model_folder, load_checked, note_upcast
from ..common.padding import padded_length
from ..data.tokenizer import check_tokenizer
from ..finetuning.chunked import pooler_problem
from ..model.bert_baseline import BertForSparseMaskedLM, bert_config
from ..model.config import ConceptEncoderConfig
from ..model.constants import CLASSIFIER_POOLINGS, TOKEN_QUERY_DECODERS
from ..model.construct import construct
from ..model.heads import ConceptEncoderForMaskedLM
from ..model.positions import extend_position_tables
from ..model.summary import parameter_counts
from .plan import fresh_model_fields
from .preflight import beyond_positions

logger = logging.getLogger(__name__)


def held_parameters(model) -> dict[str, int]:
    """Parameter elements this process holds (`local`) of the model's `total`: equal unless ZeRO-3 built the
    model partitioned (a partitioned parameter keeps its shard in `ds_tensor` and its full size in `ds_numel`,
    with no data of its own between forwards); tied weights once."""
    unique = {id(p): p for p in model.parameters()}.values()
    local = sum(p.numel() + (p.ds_tensor.numel() if hasattr(p, "ds_tensor") else 0) for p in unique)
    return {"local": local, "total": parameter_counts(model)["total"]}


def build_model(model_args, data_args, tokenizer, objective: str = "mlm", seed: int = 0, zero3_config=None):
    """A fresh preset (vocabulary and special ids from the tokenizer, position table grown to the
    sequence length; weights from `seed`, partitioned under `zero3_config`: `construct`) or the saved model
    of `model_args.model_name_or_path`: a `ConceptEncoderForMaskedLM`, or with `--architecture bert` the
    `BertForSparseMaskedLM` baseline of the same shape; checked against the tokenizer, the sequence length
    and the objective; activation checkpointing on request."""
    bert = model_args.architecture == "bert"
    model_class = BertForSparseMaskedLM if bert else ConceptEncoderForMaskedLM
    # a fresh model's position table covers the longest batch, padded (--pad_to_multiple_of)
    longest = padded_length(data_args.max_seq_length, getattr(data_args, "pad_to_multiple_of", None))
    if model_args.model_name_or_path:
        model = from_pretrained(model_class, model_args.model_name_or_path, zero3_config)
        if model_args.extend_positions == "copy" and data_args.max_seq_length > model.config.max_position_embeddings:
            if zero3_config is not None:
                raise ValueError(
                    "--extend_positions copy cannot grow a table ZeRO-3 partitions; run it once without ZeRO-3 "
                    "(a ZeRO-0/1/2 config or none) and continue from that run's model"
                )
            trained = extend_position_tables(model, data_args.max_seq_length)
            logger.info("position tables grown from %d to %d rows (copies of the trained rows)", trained,
                        data_args.max_seq_length)  # fmt: skip
    elif bert:
        fields = fresh_model_fields(model_args, longest, len(tokenizer))
        config = bert_config(fields, len(tokenizer), pad_token_id=tokenizer.pad_token_id)
        model = construct(BertForSparseMaskedLM, config, seed, zero3_config)
    else:
        fields = fresh_model_fields(
            model_args,
            longest,
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            mask_token_id=tokenizer.mask_token_id,
            cls_token_id=tokenizer.cls_token_id,
            sep_token_id=tokenizer.sep_token_id,
            unk_token_id=tokenizer.unk_token_id,
        )
        model = construct(ConceptEncoderForMaskedLM, ConceptEncoderConfig(**fields), seed, zero3_config)
    check_tokenizer(tokenizer, vocab_size=model.config.vocab_size)
    if data_args.max_seq_length > model.config.max_position_embeddings:
        raise ValueError(beyond_positions(data_args.max_seq_length, model.config.max_position_embeddings))
    if objective == "tsdae" and (decoder := getattr(model.config, "decoder_type", None)) in TOKEN_QUERY_DECODERS:
        raise ValueError(
            f"{model_args.model_name_or_path} has a {decoder} decoder, which --objective tsdae cannot train (its "
            "queries are the tokens to reconstruct); start from a posonly or weighted model, or a fresh preset"
        )
    if model_args.gradient_checkpointing:
        if bert:
            model.gradient_checkpointing_enable()
        else:
            model.activation_checkpointing_enable()
    return model


def from_pretrained(model_class, path: str, zero3_config: dict | None):
    """`model_class.from_pretrained(path)` in float32 (a 16-bit folder is upcast: the optimizer updates fp32
    weights); under `zero3_config` loaded partitioned (transformers' ZeRO-3 loading, which reads the ds config
    through `HfDeepSpeedConfig`, kept alive only while loading)."""
    if zero3_config is None:
        return load_checked(model_class, path)[0]
    check_model_folder(path)  # partitioned loading: the files are checked, the tensors not gathered to check
    note_upcast(path)
    import torch
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    keep_alive = HfDeepSpeedConfig(zero3_config)  # noqa: F841 (transformers holds only a weak reference)
    try:
        return model_class.from_pretrained(path, dtype=torch.float32)  # DeepSpeed casts to 16 bits itself
    finally:
        unset_hf_deepspeed_config()


def check_pooling(config, pooling: str, where: str) -> dict:
    """Config overrides for `--pooling`: a Concept Encoder pools its concepts (`weighted` or `mean`) or, refining
    its tokens, the `[CLS]` token (`cls`); a Hugging Face encoder's classification head pools `[CLS]`, or the mean
    token state (`mean`: a reading mode, `chunked.apply_reading`, for a classifier with a pooler only:
    `chunked.pooler_problem`); any other combination is an error naming the choices."""
    if pooling == "auto":
        return {}
    concept = config.model_type == "concept_encoder"
    if concept and pooling == "cls" and not getattr(config, "token_refinement", False):
        raise ValueError(
            f"--pooling cls: {where} does not refine its tokens (token_refinement is off), so its [CLS] token never "
            "sees the input; pool mean or weighted, or fine-tune a model built with --token_refinement true"
        )
    if concept and pooling in CLASSIFIER_POOLINGS:
        return {"classifier_pooling": pooling}
    if not concept and pooling in ("cls", "mean"):
        if pooling == "mean" and (problem := pooler_problem(config)):
            raise ValueError(f"--pooling mean: {where}: {problem}")
        return {}
    allowed = ["auto", *sorted(CLASSIFIER_POOLINGS)] if concept else ["auto", "cls", "mean"]
    raise ValueError(
        f"--pooling {pooling}: {where} ({config.model_type}) supports {allowed}"
        + ("" if concept else "; its sequence-classification head pools [CLS] or, with mean, its mean token state")
    )


def build_classifier(
    model_path: str, task, from_scratch: bool = False, pooling: str = "auto", extend_to: int | None = None
):
    """`AutoModelForSequenceClassification` for `task` from a saved folder: a Concept Encoder (its MLM
    decoder is dropped, with a log line saying so) or any HF encoder such as BERT; `from_scratch`
    builds the same architecture with fresh weights (from torch's global generator: seed it first). `extend_to`:
    position tables shorter than this grow to it (`extend_position_tables`; a fresh twin's table is sized to it).
    Returns (model, what was done, for the log: the dropped tensors and, by full name, every newly initialised
    parameter)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    labels = {}
    if task.label_names:
        labels = {
            "id2label": dict(enumerate(task.label_names)),
            "label2id": {n: i for i, n in enumerate(task.label_names)},
        }
    check_model_folder(model_path, weights=not from_scratch)  # one line for a folder that is not what it claims
    config = AutoConfig.from_pretrained(model_path, num_labels=task.num_labels, problem_type=task.task_type, **labels)
    for key, value in check_pooling(config, pooling, model_path).items():
        setattr(config, key, value)
    if from_scratch:
        if extend_to is not None and extend_to > config.max_position_embeddings:
            config.max_position_embeddings = extend_to
        # float32 whatever config.json's dtype says (transformers' from_config would follow it)
        twin = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        return twin, "fresh weights (--from_scratch)"
    model, info = load_checked(AutoModelForSequenceClassification, model_path, config=config)
    grown = ""
    if extend_to is not None and extend_to > config.max_position_embeddings:
        grown = f"; position tables grown from {extend_position_tables(model, extend_to)} to {extend_to} rows"
    dropped = sorted({key.split(".")[0] for key in info["unexpected_keys"]})
    note = (
        f"pretrained weights; dropped {len(info['unexpected_keys'])} tensors of {dropped}"
        if dropped
        else "pretrained weights"
    )
    new = sorted(info["missing_keys"])
    return model, note + grown + (f"; new (randomly initialised): {new}" if new else "")
