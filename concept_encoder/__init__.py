"""Concept Encoders: C learned concepts cross-attend to N tokens (O(N·C)) instead of token self-attention.

`python -m concept_encoder` prints the size presets with exact parameter counts.
Importing this package registers the model with transformers' Auto classes, so
`AutoModelForMaskedLM.from_pretrained(path)` works on a saved Concept Encoder.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
)

from .config import PRESETS, ConceptEncoderConfig, config_from_preset
from .heads import ConceptEncoderForMaskedLM, ConceptEncoderForSequenceClassification, ConceptMaskedLMOutput
from .modeling import ConceptEncoder, ConceptEncoderPreTrainedModel
from .summary import format_preset_table, parameter_counts, preset_parameter_counts

AutoConfig.register(ConceptEncoderConfig.model_type, ConceptEncoderConfig, exist_ok=True)
AutoModel.register(ConceptEncoderConfig, ConceptEncoder, exist_ok=True)
AutoModelForMaskedLM.register(ConceptEncoderConfig, ConceptEncoderForMaskedLM, exist_ok=True)
AutoModelForSequenceClassification.register(
    ConceptEncoderConfig, ConceptEncoderForSequenceClassification, exist_ok=True
)

__all__ = [
    "PRESETS",
    "ConceptEncoder",
    "ConceptEncoderConfig",
    "ConceptEncoderForMaskedLM",
    "ConceptEncoderForSequenceClassification",
    "ConceptEncoderPreTrainedModel",
    "ConceptMaskedLMOutput",
    "config_from_preset",
    "format_preset_table",
    "parameter_counts",
    "preset_parameter_counts",
]
