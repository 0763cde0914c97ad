"""JSON the project writes is JSON every reader takes: no `NaN` or `Infinity` (Python's `json` writes them by
default; they are not JSON, and jq, JavaScript and most JSON libraries refuse the file). A non-finite float is
written as null, which says "no number" in the file itself (a NaN loss of a step with no masked token, an eval
that diverged)."""

from __future__ import annotations

import json
import math


def finite(value):
    """`value` with every non-finite float (also inside dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def dumps(value, **kwargs) -> str:
    """`json.dumps` of `finite(value)`, refusing any non-finite number left (e.g. one `default=` made)."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
