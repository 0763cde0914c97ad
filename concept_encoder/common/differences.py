"""How every "reuse only what matches" refusal names what differs: resumes (`training/resume.py`), curve and
ablation requests (`decide/`), fine-tuning reports compared (`finetuning/report.py`)."""

from __future__ import annotations


def differences(saved: dict, current: dict, saved_as: str, current_as: str, keys=None) -> list[str]:
    """`key: <saved_as> <saved value>, <current_as> <current value>` for every key (of `keys`, default both
    dicts') whose values differ: how every "reuse only what matches" refusal names what differs (resumes, curve
    requests, ablation runs)."""
    keys = sorted(set(saved) | set(current)) if keys is None else keys
    return [f"{key}: {saved_as} {saved.get(key)!r}, {current_as} {current.get(key)!r}"
            for key in keys if saved.get(key) != current.get(key)]  # fmt: skip
