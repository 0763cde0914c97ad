"""What every data source shares, torch- and datasets-free: the source error, the Hub's reachability (checked in
seconds, before a library's retry loops), and the paragraph helpers the offline corpora cut their text with."""

from __future__ import annotations

import os
import re
import socket
from urllib.parse import urlparse


class DataSourceError(RuntimeError):
    """A dataset or tokenizer source cannot be used; the message says why and what to do."""


def paragraphs_of(text: str) -> list[str]:
    """The non-blank paragraphs of `text` (cut at blank lines), stripped."""
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def group_paragraphs(paragraphs: list[str], min_words: int) -> list[str]:
    """Consecutive paragraphs joined (blank line between) until a group has `min_words` words; the rest last."""
    documents, group, words = [], [], 0
    for paragraph in paragraphs:
        group.append(paragraph)
        words += len(paragraph.split())
        if words >= min_words:
            documents.append("\n\n".join(group))
            group, words = [], 0
    if group:
        documents.append("\n\n".join(group))
    return documents


def hub_is_offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connection to the Hub endpoint, so an unreachable Hub fails in seconds, not after retries."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def unreachable_message(kind: str, name: str, reason: str) -> str:
    return (
        f"cannot load {kind} {name!r} from the Hugging Face Hub: {reason}. "
        f"Use a local path instead (a file or folder of .txt/.jsonl/.json/.parquet for datasets, a folder "
        f"saved with save_pretrained for tokenizers), `--dataset embedded` for the built-in offline corpus, "
        f"or `--tokenizer train:wordpiece:8000` to train a tokenizer locally."
    )


def ensure_hub(kind: str, name: str) -> None:
    """Fail fast, before `datasets`/`huggingface_hub` start their retry loops."""
    if not hub_is_offline() and not hub_reachable():
        raise DataSourceError(unreachable_message(kind, name, "the Hub is unreachable from this machine"))
