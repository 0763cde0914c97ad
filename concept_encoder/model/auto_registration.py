"""Registration with transformers' Auto classes that does not make `import concept_encoder` import torch.

The package top must stay torch-free (the plan checker imports `concept_encoder.accounting.memory`, which runs
`concept_encoder/__init__.py` first), yet both of these must work::

    from concept_encoder import ConceptEncoderForMaskedLM          # registers, like any HF model package
    import concept_encoder; AutoModelForMaskedLM.from_pretrained(path)

So the classes register themselves when their modules load (`config.py` registers the config with
`AutoConfig`, `heads.py` the models with `AutoModel*`), and `import concept_encoder` installs an
import hook: when transformers finishes loading its Auto mappings (`configuration_auto`,
`modeling_auto`), the matching module of ours is imported, which registers it. By then transformers
has imported torch itself, so the hook costs nothing a user of the Auto classes does not pay anyway.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

# transformers module → our module whose import registers the classes that mapping needs
TRIGGERS = {
    "transformers.models.auto.configuration_auto": "concept_encoder.model.config",
    "transformers.models.auto.modeling_auto": "concept_encoder.model.heads",
}


class ImportAfter(importlib.abc.MetaPathFinder):
    """A meta-path finder that, once a trigger module has executed, imports our module for it."""

    def __init__(self, triggers: dict[str, str]):
        self.triggers = dict(triggers)

    def find_spec(self, fullname, path, target=None):
        ours = self.triggers.get(fullname)
        if ours is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_then_import_ours(module):
            execute(module)
            ensure_imported(ours)

        spec.loader.exec_module = exec_then_import_ours
        return spec


def ensure_imported(module: str) -> None:
    """Import `module` unless it is loaded or loading (then it registers itself when it finishes)."""
    if module not in sys.modules:
        importlib.import_module(module)


def install() -> None:
    """Called by `import concept_encoder`: registers now where transformers' mappings are already
    loaded (torch is then loaded too), else when they load."""
    if not any(isinstance(finder, ImportAfter) for finder in sys.meta_path):
        sys.meta_path.insert(0, ImportAfter(TRIGGERS))
    for trigger, ours in TRIGGERS.items():
        if trigger in sys.modules:
            ensure_imported(ours)
