"""Tiny Hugging Face token encoders from configs built here (no download): BERT, RoBERTa, DistilBERT and MPNet of
width 32, 2 heads, an FFN of 64, each under its own architecture's config names (DistilBERT: dim, n_heads, ...)."""

from pathlib import Path

from transformers import AutoModelForMaskedLM, BertConfig, DistilBertConfig, MPNetConfig, RobertaConfig

POSITIONS = 128  # tokens each reads; RoBERTa's and MPNet's position ids start after their padding index


def tiny_config(kind: str, vocab_size: int, pad_token_id: int = 0, layers: int = 2, **extra):
    """The config of a tiny `kind` encoder (`extra`: more config fields, e.g. num_labels)."""
    common = {"vocab_size": vocab_size, "pad_token_id": pad_token_id, **extra}
    if kind == "distilbert":
        return DistilBertConfig(dim=32, n_layers=layers, n_heads=2, hidden_dim=64, max_position_embeddings=POSITIONS,
                                **common)  # fmt: skip
    config_class, skipped = {"bert": (BertConfig, 0), "roberta": (RobertaConfig, pad_token_id + 1),
                             "mpnet": (MPNetConfig, 2)}[kind]  # fmt: skip
    return config_class(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=POSITIONS + skipped, **common)  # fmt: skip


def save_token_encoder(folder: Path, kind: str, tokenizer, layers: int = 2) -> Path:
    """An untrained `kind` MLM model and `tokenizer` saved in `folder`, as a downloaded checkpoint is."""
    config = tiny_config(kind, len(tokenizer), tokenizer.pad_token_id, layers)
    AutoModelForMaskedLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
