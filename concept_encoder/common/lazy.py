"""Lazy package attributes (PEP 562): a package names its public objects, their modules load on first use.

This keeps `import concept_encoder.accounting.memory` (the plan checker's import) free of torch and
transformers' model code, while `from concept_encoder import ConceptEncoderForMaskedLM` still works.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_attributes(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list]]:
    """`exports` maps a public name to the submodule (relative to `package`) that defines it.

    Returns the package's `__getattr__` and `__dir__`. A loaded name is cached in the package's
    namespace, so each is resolved once.
    """

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(exports))

    return __getattr__, __dir__
