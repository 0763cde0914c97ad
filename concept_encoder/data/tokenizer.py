"""Tokenizers: a Hub name or local folder (`AutoTokenizer`), or `train:<kind>:<vocab_size>`.

A trained tokenizer is cached under `<cache_dir>/tokenizers/<key>`, the key naming the
kind, vocabulary size and the corpus it was trained on, so later runs load it instead
of training again. Training is not deterministic (the `tokenizers` library breaks ties between
equally frequent pairs in hash-map order, which no setting fixes: two trainings on the same text
differ in some tens of ids), so the cache entry is written once, under a lock, into a temporary
folder renamed into place; an entry that fails to load is named and rebuilt; and a training run
keeps the tokenizer it started with in its own folder (`<run>/tokenizer`), which its resumes use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from accelerate import PartialState
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ..common.paths import cache_path, written_aside
from .base import DataSourceError, ensure_hub, unreachable_message
from .listops_vocab import SYMBOLS, VOCAB_VERSION
from .recall_vocab import VOCAB_VERSION as RECALL_VERSION
from .recall_vocab import parse_recall_tokenizer, recall_symbols

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = {
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "mask_token": "[MASK]",
}
TRAINABLE_KINDS = ("wordpiece", "bpe")


def parse_train_spec(spec: str) -> tuple[str, int] | None:
    """`train:wordpiece:8000` → (`wordpiece`, 8000); any other spec → None."""
    if not spec.startswith("train:"):
        return None
    match = re.fullmatch(r"train:(\w+):(\d+)", spec)
    if not match or match.group(1) not in TRAINABLE_KINDS:
        raise ValueError(f"--tokenizer {spec!r}: expected train:<kind>:<vocab_size> with kind in {TRAINABLE_KINDS}")
    vocab_size = int(match.group(2))
    if vocab_size < len(SPECIAL_TOKENS) + 26:
        raise ValueError(f"--tokenizer {spec!r}: vocab_size {vocab_size} is too small; use at least a few hundred")
    return match.group(1), vocab_size


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:60]


def trained_tokenizer_dir(cache_dir: str | Path, kind: str, vocab_size: int, corpus_id: str) -> Path:
    digest = hashlib.sha1(corpus_id.encode()).hexdigest()[:8]
    return cache_path(cache_dir) / "tokenizers" / f"{kind}-{vocab_size}-{slug(corpus_id)}-{digest}"


def train_tokenizer(kind: str, vocab_size: int, texts: Iterator[str]) -> PreTrainedTokenizerFast:
    """Train a lower-cased WordPiece (BERT-style) or byte-level BPE tokenizer with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    specials = list(SPECIAL_TOKENS.values())
    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials)
    else:
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() <= len(specials) + (256 if kind == "bpe" else 0):  # learned nothing beyond its alphabet
        raise DataSourceError(
            "the tokenizer was trained on no text: the training split is empty (with --streaming, the first "
            "--streaming_validation_documents documents are held out for validation); use more data, hold out "
            "fewer documents, or pass a trained tokenizer with --tokenizer"
        )
    return framed(tok)


def framed(tok) -> PreTrainedTokenizerFast:
    """A `tokenizers.Tokenizer` holding `SPECIAL_TOKENS`, as a transformers tokenizer that frames every input
    `[CLS] a [SEP]` (a pair `[CLS] a [SEP] b [SEP]`, the second segment type 1), as BERT's inputs are."""
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")],
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1_000_000, **SPECIAL_TOKENS)


def load_tokenizer(
    spec: str,
    texts: Iterator[str] | None = None,
    corpus_id: str = "",
    cache_dir: str | Path = "Cache",
) -> PreTrainedTokenizerBase:
    """Load or train the tokenizer named by `spec`; `texts` is the training corpus for `train:` specs. `listops`
    and `recall[:<keys>:<values>]` are fixed vocabularies (`fixed_vocabulary`), saved once under
    `<cache_dir>/tokenizers/`."""
    trained = parse_train_spec(spec)
    if (fixed := fixed_vocabulary(spec)) is not None:
        tokenizer = fixed_tokenizer(*fixed, cache_dir)
    elif trained is not None:
        kind, vocab_size = trained
        path = trained_tokenizer_dir(cache_dir, kind, vocab_size, corpus_id)
        with PartialState().main_process_first():
            tokenizer = cached_trained_tokenizer(path, spec, kind, vocab_size, texts)
    else:
        local = Path(spec).expanduser()
        if not local.exists():
            if spec.startswith((".", "/", "~")):
                raise DataSourceError(f"--tokenizer {spec!r}: no such folder")
            ensure_hub("tokenizer", spec)
        if local.is_dir():
            require_tokenizer_files(local, f"--tokenizer {spec}")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else spec)
        except OSError as error:
            raise DataSourceError(unreachable_message("tokenizer", spec, str(error).splitlines()[0])) from error
    check_tokenizer(tokenizer)
    return tokenizer


FIXED_LISTOPS = "listops"


def fixed_vocabulary(spec: str) -> tuple[str, tuple[str, ...]] | None:
    """The fixed vocabularies a `--tokenizer` spec names, as (cache folder name, symbols): `listops`
    (`listops_vocab.py`) and `recall[:<keys>:<values>]` (`recall_vocab.py`); None for any other spec."""
    if spec == FIXED_LISTOPS:
        return f"listops-v{VOCAB_VERSION}", SYMBOLS
    if (recall := parse_recall_tokenizer(spec)) is not None:
        return f"recall-{recall[0]}-{recall[1]}-v{RECALL_VERSION}", recall_symbols(*recall)
    return None


def symbol_tokenizer(symbols: tuple[str, ...]) -> PreTrainedTokenizerFast:
    """A fixed tokenizer: a `tokenizers` WordLevel over `SPECIAL_TOKENS` then `symbols`, split on whitespace,
    `[CLS] … [SEP]` around every input. Not trained: the vocabulary is a generated task's, fixed by its rules."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS.values(), *symbols])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return framed(tok)


def fixed_tokenizer(name: str, symbols: tuple[str, ...], cache_dir: str | Path = "Cache") -> PreTrainedTokenizerBase:
    """A fixed tokenizer as a saved folder (`<cache_dir>/tokenizers/<name>`), written once."""
    path = cache_path(cache_dir) / "tokenizers" / name
    with cache_lock(path):
        if not (path / "tokenizer.json").exists():
            with written_aside(path, replace_existing=True) as partial:
                symbol_tokenizer(symbols).save_pretrained(partial)
    return AutoTokenizer.from_pretrained(path)


@contextlib.contextmanager
def cache_lock(path: Path | None):
    """A file lock beside the cache entry `path` (nothing without one): two processes that build the same
    entry (a tokenizer, processed blocks) take turns, and the second finds what the first wrote."""
    if path is None:
        yield
        return
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        yield


def first_line(error: BaseException) -> str:
    """`Type: first line of the message`, for one-line reports of a damaged cache entry."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def cached_trained_tokenizer(path: Path, spec: str, kind: str, vocab_size: int, texts) -> PreTrainedTokenizerBase:
    """The cache entry at `path`, trained and written first if missing (or unreadable: named, then rebuilt).
    A file lock serialises two processes on one entry (the second loads what the first wrote); the entry
    is written to a temporary folder and renamed, so no reader ever sees half of it."""
    with cache_lock(path):
        if (path / "tokenizer.json").exists():
            try:
                return AutoTokenizer.from_pretrained(path)
            except Exception as error:  # a damaged entry: say which, then rebuild it
                logger.warning("tokenizer cache %s does not load (%s): rebuilding it", path, first_line(error))
                shutil.rmtree(path)
        if texts is None:
            raise ValueError(f"--tokenizer {spec!r} needs training texts and none were given")
        with written_aside(path, replace_existing=True) as partial:
            train_tokenizer(kind, vocab_size, texts).save_pretrained(partial)
        return AutoTokenizer.from_pretrained(path)


def vocab_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the vocabulary (every token and its id): equal digests, equal id mapping."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()


# A folder holding none of these has no tokenizer: transformers would build a default one (5 tokens for BERT).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")  # fmt: skip


def require_tokenizer_files(folder: Path, what: str, fix: str = "") -> None:
    """DataSourceError when `folder` holds no tokenizer file: a model saved by `save_pretrained` alone would
    otherwise get a default tokenizer with a handful of tokens and train on nonsense ids without a word."""
    if not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        raise DataSourceError(
            f"{what}: {folder} holds no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...); "
            + (fix or "point it at a folder with the tokenizer files, e.g. a run's final/")
        )


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab_size: int | None = None) -> None:
    """MLM needs pad and mask tokens; a model's embedding table must cover every token id."""
    missing = [name for name in ("pad_token", "mask_token") if getattr(tokenizer, name) is None]
    if missing:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no {' or '.join(missing)}; MLM needs both. "
            f"Add them (tokenizer.add_special_tokens) or train one with --tokenizer train:wordpiece:<vocab>"
        )
    if vocab_size is not None:
        check_vocab_covers(tokenizer, vocab_size)


def check_vocab_covers(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """Every token id must have a row in the model's embedding table."""
    if vocab_size < len(tokenizer):
        raise ValueError(
            f"model vocab_size={vocab_size} is smaller than the tokenizer {tokenizer.name_or_path!r} "
            f"({len(tokenizer)} tokens); build the model with vocab_size >= {len(tokenizer)}, or use the "
            "tokenizer the model was trained with"
        )


def model_tokenizer_folder(model_path: str | Path, tokenizer: str | None, flag: str = "--tokenizer") -> str:
    """The tokenizer a saved model is read with: its folder's own, the one its weights were trained with;
    `tokenizer` only for a folder saved without one. A different `tokenizer` beside a folder that has its own is
    refused (every token id would read an embedding learnt for another token), and so is a folder without one
    when no `tokenizer` folder is given (a tokenizer trained afresh would pair its ids with the model's likewise)."""
    folder = Path(model_path)
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        if tokenizer is not None and Path(tokenizer).expanduser().resolve() != folder.resolve():
            raise DataSourceError(
                f"{flag} {tokenizer}: {folder} has its own tokenizer, the one its weights were trained with (with "
                f"another, token ids would not mean what the model learned); leave {flag} out"
            )
        return str(folder)
    if tokenizer is None:
        require_tokenizer_files(folder, f"--model_name_or_path {folder}",
                                f"pass {flag} <the folder of the tokenizer it was trained with>")  # fmt: skip
    require_tokenizer_files(Path(tokenizer), f"{flag} {tokenizer}",
                            f"{flag} must be the folder of the tokenizer {folder} was trained with")  # fmt: skip
    return str(tokenizer)
