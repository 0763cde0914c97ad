"""Step 7 of the init order: the model the loop trains, fresh from a preset or loaded from a folder."""

from __future__ import annotations

from ..config import ConceptEncoderConfig
from ..data.tokenizer import check_tokenizer
from ..heads import ConceptEncoderForMaskedLM
from .plan import fresh_model_fields


def build_model(model_args, data_args, tokenizer) -> ConceptEncoderForMaskedLM:
    """A fresh preset (vocabulary and special ids from the tokenizer, position table grown to the
    sequence length) or the saved model of `model_args.model_name_or_path`; checked against the
    tokenizer and the sequence length; activation checkpointing on request."""
    if model_args.model_name_or_path:
        model = ConceptEncoderForMaskedLM.from_pretrained(model_args.model_name_or_path)
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
    if model_args.gradient_checkpointing:
        model.activation_checkpointing_enable()
    return model
