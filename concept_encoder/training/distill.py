"""Distillation from a pretrained sentence encoder: `--objective distill --teacher <model folder>`.

The student's pooled representation (a Concept Encoder: the mean of its concepts; BERT: the mean of its token
states over the real tokens), through a small linear projection, learns the teacher's sentence embedding: the
mean of the teacher's last hidden states over its real tokens, the pooling sentence-transformers' all-MiniLM
models use (Reimers & Gurevych 2020 train students this way). The loss is `1 - cos` (`--distill_loss cosine`,
the default: the direction is what a cosine-similarity embedding keeps) or the mean squared error per dimension
(`mse`), weighted `--distill_weight`, beside the MLM loss weighted `--mlm_weight` (0: distillation alone). The
student reads each example as the MLM objective corrupts it (masked at `--mlm_probability`); the teacher's
target is its embedding of the clean text, so the student also learns to see through the masks.

Units are documents or sentences, one per example (`--packing false`): example i of a split is document i,
which the teacher read with its own tokenizer, truncated at `--max_seq_length` of its tokens.

The teacher runs once, before training, over every document of both splits (frozen, `torch.no_grad`); its
embeddings are cached under `Cache/teachers/<key>.safetensors`, keyed by the teacher's files, the texts and the
length, so the teacher never enters the training loop: DeepSpeed wraps the student only, the teacher holds no
optimizer state and no memory during training, and a resume reads the same targets. Before that the teacher's
folder is checked like every model folder handed in, and for what mean pooling needs (`load_teacher`): a fault is
one line, not NaN targets or a traceback. The projection is the objective's own, like the learned concept-loss
weights (`objective.ConceptObjective`): its own AdamW, gradients averaged over ranks, checkpointed with the run,
not part of the saved model.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import send_to_device
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModel, AutoTokenizer

from ..checkpoints.model_folder import ModelFolderError, load_checked, model_digest
from ..common.paths import written_aside
from ..constants import DISTILL_LOSSES
from ..data.objectives import model_inputs
from ..model.constants import IGNORE_INDEX
from .objective import step_own_parameters

logger = logging.getLogger("concept_encoder")

__all__ = ["DISTILL_LOSSES", "Distillation", "attach_teacher", "carried", "init_word_embeddings", "with_doc_index"]
DOC_INDEX = "doc_index"  # batch key: which document of its split each example is (the teacher's target row)
TOKENIZER_FILES = (  # what a saved tokenizer of any kind (WordPiece, BPE, SentencePiece) reads
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json", "merges.txt",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
)  # fmt: skip


def teacher_identity(folder: Path) -> str:
    """A digest of the teacher's files that decide its embeddings (config and safetensors weights, shards included,
    by `model_folder.model_digest`; tokenizer): the cache key's teacher part, so a replaced model at the same path
    is a new teacher."""
    digest = hashlib.sha1(model_digest(folder).encode())
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            digest.update(name.encode())
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:16]


def load_teacher(folder: str | Path):
    """The teacher's encoder (`AutoModel`, frozen, eval mode, float32 on the CPU) and its own tokenizer, from a local
    folder only, checked like every model folder handed in (`model_folder.load_checked`: safetensors only, every
    tensor of the encoder in the file, every parameter finite) and then by `teacher_problem` on a probe batch; a
    fault is one `ModelFolderError` line naming the folder. Without the checks a NaN teacher gives NaN targets
    silently, a pickle-only folder an UnpicklingError traceback, a Concept Encoder a tensor-size RuntimeError."""
    try:
        model = load_checked(AutoModel, folder, local_files_only=True)[0].eval()
    except ModelFolderError as error:
        raise ModelFolderError(f"--teacher: {error}") from error
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if problem := teacher_problem(model, tokenizer):
        raise ModelFolderError(f"--teacher: {folder}: {problem}")
    return model, tokenizer


PROBE_TEXTS = ["The cat sat on the mat.", "A longer sentence, so that the batch is padded."]  # teacher_problem's batch


def teacher_problem(model, tokenizer) -> str | None:
    """Why `mean_pooled` cannot take a sentence embedding from this teacher (`tokenizer_problem`,
    `token_states_problem`), found before it embeds every document. Its width may differ from the student's: the
    projection maps one to the other; its vocabulary too: it reads the texts with its own tokenizer."""
    return tokenizer_problem(model, tokenizer) or token_states_problem(model, tokenizer)


def tokenizer_problem(model, tokenizer) -> str | None:
    """A tokenizer that knows no word of `PROBE_TEXTS` (transformers builds an empty one for a folder without
    tokenizer files: every text would be one unknown token per word, every target alike), or one with more tokens
    than the model's embedding table has rows (a text would index past it)."""
    words = tokenizer(PROBE_TEXTS[0], add_special_tokens=False)["input_ids"]
    if tokenizer.unk_token_id is not None and all(i == tokenizer.unk_token_id for i in words):
        return (f"its tokenizer reads {PROBE_TEXTS[0]!r} as unknown tokens only (no tokenizer files in the folder?); "
                "save the teacher's own tokenizer there (tokenizer.save_pretrained)")  # fmt: skip
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        return (f"its tokenizer has {len(tokenizer):,} tokens and its embedding table {rows:,} rows, so a text can "
                "index past the table; pass a folder whose tokenizer and model belong together")  # fmt: skip
    return None


def token_states_problem(model, tokenizer) -> str | None:
    """A teacher that fails on one padded batch of `PROBE_TEXTS` (e.g. a tokenizer with no padding token, a decoder
    that needs decoder inputs) or does not return one last hidden state per token (a Concept Encoder returns its
    concepts `[B,C,H]`: the mean over the real tokens would not line up with them)."""
    try:
        encoded = tokenizer(PROBE_TEXTS, truncation=True, max_length=32, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = getattr(model(**encoded), "last_hidden_state", None)
    except (RuntimeError, ValueError, TypeError, IndexError, AttributeError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"it fails to embed a padded batch of two sentences ({first}); pass an encoder such as BERT or MiniLM"
    tokens = list(encoded["input_ids"].shape)
    if hidden is None or list(hidden.shape[:2]) != tokens or hidden.dim() != 3:
        shape = "nothing" if hidden is None else list(hidden.shape)
        return (f"its {type(model).__name__} returns {shape} as last_hidden_state for {tokens} tokens, not one state "
                "per token, which the teacher's mean pooling needs; pass a token encoder such as BERT or MiniLM")  # fmt: skip
    return None


@torch.no_grad()
def mean_pooled(
    model, tokenizer, texts: list[str], max_length: int, batch_size: int = 64, desc: str = ""
) -> torch.Tensor:
    """`texts` → `[D,H_t]` float32: the mean of `model`'s last hidden states over each text's real tokens, the text
    tokenized by `tokenizer` (the teacher's own) and truncated at `max_length` tokens."""
    rows = []
    for start in tqdm(range(0, len(texts), batch_size), desc=desc, disable=not desc):
        encoded = tokenizer(texts[start : start + batch_size], truncation=True, max_length=max_length,
                            padding=True, return_tensors="pt")  # fmt: skip
        hidden = model(**encoded).last_hidden_state  # [b,n,H_t]
        mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b,n,1]
        rows.append((hidden * mask).sum(1) / mask.sum(1).clamp(min=1))
    return torch.cat(rows).float() if rows else torch.zeros(0)


def teacher_targets(
    folder: str, texts: dict[str, list[str]], max_seq_length: int, cache_dir: Path, teacher: tuple | None = None
) -> dict:
    """Per split, the teacher's embedding of every document `[D_split,H_t]`, computed once (main process first, the
    other ranks wait and read the file) and cached content-keyed as safetensors (no pickle). `teacher`: the
    (model, tokenizer) `load_teacher` already gave, else it is loaded when the cache lacks the targets."""
    root = Path(folder)
    key = hashlib.sha1(json.dumps({
        "teacher": teacher_identity(root), "max_length": max_seq_length,
        "texts": {split: hashlib.sha1("\0".join(t).encode()).hexdigest() for split, t in sorted(texts.items())},
    }).encode()).hexdigest()[:16]  # fmt: skip
    path = cache_dir / "teachers" / f"{key}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    with PartialState().main_process_first():
        if not path.is_file() and PartialState().is_main_process:
            model, tokenizer = teacher or load_teacher(root)
            length = min(max_seq_length, getattr(model.config, "max_position_embeddings", max_seq_length))
            table = {
                split: mean_pooled(model, tokenizer, t, length, desc=f"teacher {split}") for split, t in texts.items()
            }
            with written_aside(path, replace_existing=True) as partial:
                save_file({split: rows.contiguous() for split, rows in table.items()}, str(partial))
            logger.info("teacher %s: %s embedded, cached at %s", folder,
                        ", ".join(f"{len(t):,} {s} documents" for s, t in texts.items()), path)  # fmt: skip
        return load_file(str(path))


def with_doc_index(collate):
    """A DataLoader collate function that also carries each example's document index `[B]` (`DOC_INDEX`)."""

    def collate_with_index(examples: list[dict]) -> dict:
        return {**collate(examples), DOC_INDEX: torch.tensor([e[DOC_INDEX] for e in examples], dtype=torch.long)}

    return collate_with_index


def student_features(out, attention_mask: torch.Tensor) -> torch.Tensor:
    """The student's pooled representation `[B,H]`: the mean of its concepts `[B,C,H]`, or for BERT the mean of its
    token states `[B,N,H]` over the real tokens (`attention_mask [B,N]`)."""
    if out.concepts is not None:
        return out.concepts.mean(dim=1)
    mask = attention_mask.unsqueeze(-1).to(out.token_states.dtype)
    return (out.token_states * mask).sum(1) / mask.sum(1).clamp(min=1)


class Distillation:
    """The distillation term of `--objective distill`: targets, projection, loss, its optimizer and evaluation."""

    def __init__(self, targets: dict, student_width: int, args, device: torch.device):
        self.targets = {split: rows.to(device) for split, rows in targets.items()}  # [D,H_t] per split
        self.loss_name, self.weight, self.mlm_weight = args.distill_loss, args.distill_weight, args.mlm_weight
        teacher_width = self.targets["train"].shape[1]
        self.projection = nn.Linear(student_width, teacher_width).to(device)
        # at the peak rate, unscheduled, like the learned concept-loss weights (objective.ConceptObjective)
        self.optimizer = torch.optim.AdamW(self.projection.parameters(), lr=args.learning_rate, weight_decay=0.0)

    def loss(self, features: torch.Tensor, doc_index: torch.Tensor, split: str = "train") -> torch.Tensor:
        """`features [B,H]`, `doc_index [B]` → the mean distillation loss `[]` of the batch."""
        predicted = self.projection(features.float())  # [B,H_t]
        target = self.targets[split][doc_index.to(predicted.device)]  # [B,H_t]
        if self.loss_name == "cosine":
            return (1 - nn.functional.cosine_similarity(predicted, target, dim=-1)).mean()
        return nn.functional.mse_loss(predicted, target)

    def __call__(self, mlm_objective: torch.Tensor, out, batch: dict) -> tuple[torch.Tensor, dict]:
        """The micro-batch's scaled MLM term `[]` and the model's output → (the weighted sum `[]`, its terms).
        A mean over the micro-batch: accelerate's averaging over micro-batches and ranks makes it the step's mean."""
        term = self.loss(student_features(out, batch["attention_mask"]), batch[DOC_INDEX])
        return self.mlm_weight * mlm_objective + self.weight * term, {self.loss_name: term.detach()}

    def step(self, accelerator, apply: bool, loss_scale: float = 1.0) -> None:
        step_own_parameters(accelerator, self.projection.parameters(), self.optimizer, apply, loss_scale)

    @torch.no_grad()
    def evaluate(self, accelerator, model, loader, max_batches: int | None) -> dict:
        """`eval_distill_cosine`: the mean cosine between the projected student features of the clean validation
        texts and the teacher's embeddings (1 is a perfect copy), over ranks."""
        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            batch = send_to_device(batch, accelerator.device)
            nothing = torch.full_like(batch["input_ids"], IGNORE_INDEX)  # no position decoded: features only
            inputs, _, _ = model_inputs({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                                         "labels": nothing})  # fmt: skip
            out = model(**inputs, return_logits=False)
            mask = batch["attention_mask"]
            predicted = self.projection(student_features(out, mask).float())
            cosine = nn.functional.cosine_similarity(predicted, self.targets["validation"][batch[DOC_INDEX]], dim=-1)
            total += torch.stack([cosine.sum().double(), torch.tensor(len(cosine), device=total.device).double()])
        total = accelerator.reduce(total, reduction="sum")
        model.train(was_training)
        return {"eval_distill_cosine": float(total[0] / total[1].clamp(min=1))}

    def state_dict(self) -> dict:
        return {"projection": self.projection.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.projection.load_state_dict(state["projection"])
        self.optimizer.load_state_dict(state["optimizer"])


def init_word_embeddings(model, teacher_folder: str, student_tokenizer) -> None:
    """`--teacher_embedding_init`: the student's input word embeddings (tied to its MLM output) from the teacher's,
    projected to the student's width by their top principal directions (SVD of the centred table) and scaled to
    the student's initial spread. The two tokenizers must be one vocabulary (`--tokenizer <teacher folder>`)."""
    teacher, tokenizer = load_teacher(teacher_folder)
    check_shared_vocabulary(teacher_folder, tokenizer, student_tokenizer)
    embeddings = model.get_input_embeddings().weight  # [V,H_s]
    table = teacher.get_input_embeddings().weight.detach().float()  # [V_t,H_t]
    if len(table) < len(embeddings):
        raise ValueError(
            f"--teacher_embedding_init: {teacher_folder}'s embedding table has {len(table):,} rows and the student's "
            f"{len(embeddings):,}; start a fresh student (its table is as long as the shared vocabulary)"
        )
    table = table[: len(embeddings)]  # the rows of the shared vocabulary; a padded teacher table has more
    width = embeddings.shape[1]
    centred = table - table.mean(dim=0)
    _, _, directions = torch.linalg.svd(centred, full_matrices=False)  # [min(V,H_t),H_t]
    projected = centred @ directions[:width].T  # [V,min(H_s,H_t)]
    if projected.shape[1] < width:  # a student wider than its teacher: the extra dimensions start at zero
        projected = nn.functional.pad(projected, (0, width - projected.shape[1]))
    scale = embeddings.detach().float().std() / projected.std().clamp(min=1e-12)
    with torch.no_grad():
        embeddings.copy_((projected * scale).to(embeddings.dtype))
    logger.info("word embeddings initialised from %s (%d rows, %d -> %d dimensions)", teacher_folder,
                table.shape[0], table.shape[1], width)  # fmt: skip


def check_shared_vocabulary(teacher_folder, teacher_tokenizer, student_tokenizer) -> None:
    """`--teacher_embedding_init` copies the teacher's word embeddings row by row: ValueError unless the student's
    tokenizer is the teacher's vocabulary. (Distillation alone needs no shared vocabulary: each model reads the
    texts with its own tokenizer.)"""
    if teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise ValueError(
            f"--teacher_embedding_init copies {teacher_folder}'s word embeddings row by row: the student needs the "
            f"teacher's vocabulary; add --tokenizer {teacher_folder}"
        )


def attach_teacher(data, args, max_seq_length: int, cache_dir: Path) -> dict:
    """The teacher's targets for every document of `data` (`teacher_targets`), and a `DOC_INDEX` column on each
    split so a batch names its rows; ValueError when the examples are not the documents one to one.

    The teacher is loaded and checked (`load_teacher`; with `--teacher_embedding_init` its vocabulary against the
    student's) on every rank before any of them embeds a document or builds the model: a refusal is then one line
    on all ranks, none left waiting at `teacher_targets`' barrier for a main process that failed inside it."""
    splits = {"train": data.train, "validation": data.validation}
    for name, split in splits.items():
        if len(split) != len(data.documents[name]):
            raise ValueError(
                f"distillation: the {name} split holds {len(split)} examples for {len(data.documents[name])} "
                "documents; it needs one example per document (--packing false)"
            )
    texts = {name: list(data.documents[name]["text"]) for name in splits}
    teacher = load_teacher(args.teacher)
    if args.teacher_embedding_init:
        check_shared_vocabulary(args.teacher, teacher[1], data.tokenizer)
    targets = teacher_targets(args.teacher, texts, max_seq_length, cache_dir, teacher)
    data.train, data.validation = (split.add_column(DOC_INDEX, list(range(len(split)))) for split in splits.values())
    return targets


def carried(batch: dict) -> dict:
    """What a corruption must hand on beside the model's inputs: the batch's document indices, when it has them."""
    return {DOC_INDEX: batch[DOC_INDEX]} if DOC_INDEX in batch else {}
