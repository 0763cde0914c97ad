"""The model: a Hugging Face `PreTrainedModel` family (config, presets, attention blocks, the encoder, the MLM and
classification heads, the vocabulary projection), the BERT twin of the same shape, Auto-class registration and
exact parameter counts.

The files a saved model carries beside its weights (config, presets, constants, attention, modeling, heads,
vocab_projection) import only each other, with single-dot imports, so `trust_remote_code=True` loads a checkpoint
without this package. Nothing here imports the rest of the library. The public names are on `concept_encoder`.
"""
