"""Concept Encoders: C learned concepts cross-attend to N tokens (O(N·C)) instead of token self-attention.

`python -m concept_encoder <tool>` runs the package's tools (`python -m concept_encoder --help` lists them);
alone it prints the size presets with exact parameter counts.

The library, one concern per folder (data flows down this list's right-hand side, never up):

- `model/`: the Hugging Face model (config, presets, attention, encoder, heads, BERT twin, Auto registration)
- `concepts/`: what reads the `[B,C,H]` concept tensor: regularisers, their weighting, health metrics
- `accounting/`: torch-free arithmetic: the memory model and FLOPs
- `data/`: sources, corpora, tokenizer, packing, collators, corruptions
- `tasks/`: downstream tasks and their baselines
- `training/`: what the loops share, by init-order step
- `decide/`: the tools that run and judge experiments
- `common/`: paths, report names, CLI types, lazy names, process groups

The public names below load on first use (PEP 562), so the torch-free parts (`concept_encoder.accounting`,
`concept_encoder.model.presets`, `concept_encoder.training.args`) import without torch. The model registers
with transformers' Auto classes either when it is imported or when transformers loads its Auto
mappings (`concept_encoder.model.auto_registration`), so `import concept_encoder` followed by
`AutoModelForMaskedLM.from_pretrained(path)` works on a saved Concept Encoder.
"""

import sys

from .common.entry import interrupt_in_one_line
from .common.lazy import lazy_attributes
from .model import auto_registration

if sys.argv[:1] == ["-m"]:  # `python -m concept_encoder[.<module>]` is starting: Ctrl-C in its imports is one line
    interrupt_in_one_line(f"python -m {__name__}")

EXPORTS = {
    "PRESETS": "model.presets",
    "ConceptEncoderConfig": "model.config",
    "config_from_preset": "model.config",
    "ConceptEncoder": "model.modeling",
    "ConceptEncoderPreTrainedModel": "model.modeling",
    "ConceptEncoderForMaskedLM": "model.heads",
    "ConceptEncoderForSequenceClassification": "model.heads",
    "ConceptMaskedLMOutput": "model.heads",
    "format_preset_table": "model.summary",
    "parameter_counts": "model.summary",
    "preset_parameter_counts": "model.summary",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy_attributes(__name__, EXPORTS)

auto_registration.install()
