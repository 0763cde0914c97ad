"""Step 7 of the init order: the model the loop trains, fresh from a preset or loaded from a folder."""

from __future__ import annotations

from ..bert_baseline import BertForSparseMaskedLM, bert_config
from ..config import ConceptEncoderConfig
from ..data.tokenizer import check_tokenizer
from ..heads import ConceptEncoderForMaskedLM
from .plan import fresh_model_fields


def build_model(model_args, data_args, tokenizer, objective: str = "mlm"):
    """A fresh preset (vocabulary and special ids from the tokenizer, position table grown to the
    sequence length) or the saved model of `model_args.model_name_or_path`: a `ConceptEncoderForMaskedLM`,
    or with `--architecture bert` the `BertForSparseMaskedLM` baseline of the same shape; checked against
    the tokenizer, the sequence length and the objective; activation checkpointing on request."""
    bert = model_args.architecture == "bert"
    model_class = BertForSparseMaskedLM if bert else ConceptEncoderForMaskedLM
    if model_args.model_name_or_path:
        model = model_class.from_pretrained(model_args.model_name_or_path)
    elif bert:
        fields = fresh_model_fields(model_args, data_args.max_seq_length, len(tokenizer))
        model = BertForSparseMaskedLM(bert_config(fields, len(tokenizer), pad_token_id=tokenizer.pad_token_id))
    else:
        fields = fresh_model_fields(
            model_args,
            data_args.max_seq_length,
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            mask_token_id=tokenizer.mask_token_id,
            cls_token_id=tokenizer.cls_token_id,
            sep_token_id=tokenizer.sep_token_id,
            unk_token_id=tokenizer.unk_token_id,
        )
        model = ConceptEncoderForMaskedLM(ConceptEncoderConfig(**fields))
    check_tokenizer(tokenizer, vocab_size=model.config.vocab_size)
    if data_args.max_seq_length > model.config.max_position_embeddings:
        raise ValueError(
            f"max_seq_length={data_args.max_seq_length} exceeds the model's max_position_embeddings="
            f"{model.config.max_position_embeddings}; lower --max_seq_length"
        )
    if objective == "tsdae" and getattr(model.config, "decoder_type", None) == "perceiver":
        raise ValueError(
            f"{model_args.model_name_or_path} has a perceiver decoder, which --objective tsdae cannot train (its "
            "queries are the tokens to reconstruct); start from a posonly or weighted model, or a fresh preset"
        )
    if model_args.gradient_checkpointing:
        if bert:
            model.gradient_checkpointing_enable()
        else:
            model.activation_checkpointing_enable()
    return model


def build_classifier(model_path: str, task, from_scratch: bool = False):
    """`AutoModelForSequenceClassification` for `task` from a saved folder: a Concept Encoder (its MLM
    decoder is dropped, with a log line saying so) or any HF encoder such as BERT; `from_scratch`
    builds the same architecture with fresh weights. Returns (model, what was done, for the log)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    labels = {}
    if task.label_names:
        labels = {
            "id2label": dict(enumerate(task.label_names)),
            "label2id": {n: i for i, n in enumerate(task.label_names)},
        }
    config = AutoConfig.from_pretrained(model_path, num_labels=task.num_labels, problem_type=task.task_type, **labels)
    if from_scratch:
        return AutoModelForSequenceClassification.from_config(config), "fresh weights (--from_scratch)"
    model, info = AutoModelForSequenceClassification.from_pretrained(
        model_path, config=config, output_loading_info=True
    )
    dropped = sorted({key.split(".")[0] for key in info["unexpected_keys"]})
    note = (
        f"pretrained weights; dropped {len(info['unexpected_keys'])} tensors of {dropped}"
        if dropped
        else "pretrained weights"
    )
    new = sorted({key.split(".")[0] for key in info["missing_keys"]})
    return model, note + (f"; new (randomly initialised): {new}" if new else "")
