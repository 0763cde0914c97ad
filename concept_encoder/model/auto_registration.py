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
    """A meta-path finder that, once a trigger module has executed, imports our module for it.

    Not at once when one of our model modules is still executing: `from concept_encoder import ConceptEncoder`
    loads `modeling.py`, whose transformers imports load `modeling_auto`, and importing `heads.py` then would
    read a half-executed `modeling.py` (an ImportError). So our model modules are watched too, and the
    registration waits until the outermost of them has finished."""

    def __init__(self, triggers: dict[str, str]):
        self.triggers = dict(triggers)
        self.pending: list[str] = []  # our modules to import once none of ours is executing
        self.executing = 0  # how many of our model modules are executing now (nested imports)

    def find_spec(self, fullname, path, target=None):
        ours = self.triggers.get(fullname)
        watched = fullname.startswith(OUR_MODELS)
        if ours is None and not watched:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_then_import_ours(module):
            self.executing += watched
            try:
                execute(module)
            finally:
                self.executing -= watched
            if ours is not None:
                self.pending.append(ours)
            self.import_pending()

        spec.loader.exec_module = exec_then_import_ours
        return spec

    def import_pending(self) -> None:
        """Import what the triggers asked for, unless one of our model modules is still executing."""
        while self.pending and self.executing == 0:
            ensure_imported(self.pending.pop(0))


OUR_MODELS = "concept_encoder.model."


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
