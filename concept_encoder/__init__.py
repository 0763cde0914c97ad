"""Concept Encoders: C learned concepts cross-attend to N tokens (O(N·C)) instead of token self-attention.

`python -m concept_encoder` prints the size presets with exact parameter counts.

The public names below load on first use (PEP 562), so the torch-free parts (`concept_encoder.memory`,
`concept_encoder.presets`, `concept_encoder.training.args`) import without torch. The model registers
with transformers' Auto classes either when it is imported or when transformers loads its Auto
mappings (`concept_encoder.auto_registration`), so `import concept_encoder` followed by
`AutoModelForMaskedLM.from_pretrained(path)` works on a saved Concept Encoder.
"""

from . import auto_registration
from .lazy import lazy_attributes

EXPORTS = {
    "PRESETS": "presets",
    "ConceptEncoderConfig": "config",
    "config_from_preset": "config",
    "ConceptEncoder": "modeling",
    "ConceptEncoderPreTrainedModel": "modeling",
    "ConceptEncoderForMaskedLM": "heads",
    "ConceptEncoderForSequenceClassification": "heads",
    "ConceptMaskedLMOutput": "heads",
    "format_preset_table": "summary",
    "parameter_counts": "summary",
    "preset_parameter_counts": "summary",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy_attributes(__name__, EXPORTS)

auto_registration.install()
