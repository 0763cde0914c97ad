"""The training batches of both loops: windows of micro-batches, epoch after epoch, resumable exactly."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import torch
from accelerate import skip_first_batches
from accelerate.utils import send_to_device


def accumulation_windows(loader, accumulation: int, state, finish_batch):
    """Yield lists of `accumulation` micro-batches forever, epoch after epoch, resuming at `state`.

    `finish_batch` (masking + device placement) runs as a window is handed out, not when the
    DataLoader prefetches, so masking randomness is drawn only for batches that are trained on.
    An incomplete window at the end of an epoch is dropped, so every optimizer step sees the
    same number of micro-batches. `state.epoch` / `state.batches_in_epoch` (a `TrainState`) track the
    position; with accelerate's seedable sampler, `set_epoch` makes each epoch's order reproducible.
    """
    for window, position in positioned_windows(loader, accumulation, state.epoch, state.batches_in_epoch):
        state.epoch, state.batches_in_epoch = position
        yield [finish_batch(batch) for batch in window]


def positioned_windows(loader, accumulation: int, epoch: int, batches_in_epoch: int):
    """The raw windows of `accumulation_windows` from (`epoch`, `batches_in_epoch`) on, each with the position
    `(epoch, batches_in_epoch)` once it is consumed; nothing outside is changed, so windows can be read ahead."""
    while True:
        loader.set_epoch(epoch)
        source = skip_first_batches(loader, batches_in_epoch) if batches_in_epoch else loader
        iterator = iter(source)
        produced = False
        while len(window := list(itertools.islice(iterator, accumulation))) == accumulation:
            produced = True
            batches_in_epoch += accumulation
            yield window, (epoch, batches_in_epoch)
        if not produced and batches_in_epoch == 0:
            raise ValueError(
                "the training set is too small for one optimizer step: lower per_device_train_batch_size "
                "or gradient_accumulation_steps, or use more data (with --streaming, the first "
                "--streaming_validation_documents documents are held out for validation)"
            )
        epoch += 1
        batches_in_epoch = 0


def pinned(batch: dict, device: torch.device) -> dict:
    """`batch`'s tensors in pinned (page-locked) host memory when `device` is a CUDA device, else `batch` itself.

    Pinning pays where a tensor is copied after it: a copy from pinned memory with `non_blocking=True` is queued
    on the stream and the host goes on (`placed`), while a copy from pageable memory is staged by the driver and
    may wait for the stream, and torch's blocking copy waits for it in any case (a host sync per tensor). So the
    loops pin after masking (masking makes new tensors: a DataLoader's `pin_memory` before it would pin tensors
    the step never copies), on the masking thread when it runs ahead (`MaskingAhead`), and their DataLoaders do not
    pin. Non-tensor values are kept as they are."""
    if device.type != "cuda":
        return batch
    return {key: value.pin_memory() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def placed(batch: dict, device: torch.device) -> dict:
    """`batch` (`pinned`) on `device`, copied with `non_blocking=True`: queued behind the step before it, no host
    sync. torch's pinned-memory allocator keeps a pinned block until the copies queued from it have run, so the
    host batch may be dropped at once; from pageable memory (a CPU device: no copy at all) the copy is as safe."""
    return send_to_device(batch, device, non_blocking=True)


def unpadded_or_marked(batch: dict) -> dict:
    """A padded CPU batch without its `attention_mask` when it holds no padding (any encoder reads all tokens
    then), else with `padded=True` (a Concept Encoder then keeps the mask without testing it: a host sync on the
    device, `modeling.padding_mask`; fine-tuning's collate, `loops/finetune.py`, keeps `padded` only for a model
    that takes it)."""
    if "attention_mask" not in batch:
        return batch
    if bool(batch["attention_mask"].all()):
        return {k: v for k, v in batch.items() if k != "attention_mask"}
    return {**batch, "padded": True}


class MaskingAhead:
    """The training windows, each masked on a background thread while the step before it runs (`ahead=True`),
    with the same masks, the same checkpoints and the same resume as masking in the loop (`ahead=False`).

    `windows(...)` replaces `accumulation_windows(loader, accumulation, state, place ∘ finish_batch)`; the loop
    checkpoints this object in place of `corruption` (`{"collator": masking}`). Ahead, when window k is handed
    out the loop's thread reads raw window k+1 from the DataLoader (collated by its workers) and a one-thread
    executor masks it (`finish_batch`) while step k runs; `place` (device placement) stays on the loop's thread.
    What makes it exact: only one thread ever masks, one window at a time and in order, so the corruption's
    generator draws the same stream; every window carries the generator's state and the loader position as of
    its end, and handing it out publishes them, so `state_dict()` and `state` (a `TrainState`) after step k are
    those of window k, not of window k+1 already masked; the DataLoader is iterated on the loop's thread only
    (its epoch turnover, accelerate's `GradientState` bookkeeping and any collective stay in one order). The
    background mask of the window after the last step is drawn and dropped, never checkpointed.

    Written here because no library masks ahead with a checkpointable position: DataLoader workers would each
    draw from a copy of the generator (other masks, no single state to save), and accelerate's and torch's
    prefetching hold no notion of a per-window random state.
    """

    def __init__(self, corruption, ahead: bool):
        self.corruption, self.ahead = corruption, ahead
        self.consumed = None  # the corruption's state as of the last window handed out (ahead only)

    def state_dict(self) -> dict:
        return self.corruption.state_dict() if self.consumed is None else self.consumed

    def load_state_dict(self, state: dict) -> None:
        self.corruption.load_state_dict(state)
        self.consumed = None

    def windows(self, loader, accumulation: int, state, finish_batch, place=lambda batch: batch):
        """Lists of `accumulation` micro-batches, `place(finish_batch(batch))` each, from `state` on, forever."""
        if not self.ahead:
            yield from accumulation_windows(loader, accumulation, state, lambda batch: place(finish_batch(batch)))
            return
        raw = positioned_windows(loader, accumulation, state.epoch, state.batches_in_epoch)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="masking") as executor:

            def submit():
                window, position = next(raw)
                return executor.submit(self.finish, window, finish_batch), position

            pending = submit()
            while True:
                future, position = pending
                window, consumed = future.result()
                pending = submit()  # masked on the background thread while the step of `window` runs
                state.epoch, state.batches_in_epoch = position
                self.consumed = consumed
                yield [place(batch) for batch in window]

    def finish(self, window: list, finish_batch) -> tuple[list, dict]:
        """(the masked window, the corruption's state right after it): run on the background thread."""
        masked = [finish_batch(batch) for batch in window]
        return masked, self.corruption.state_dict()


class LengthBucketedBatches:
    """Batches of examples of similar length, every example once per epoch, in an order fixed by (seed, epoch):
    a padded batch costs its longest example, so mixing a 600-token example with a 2,000-token one wastes
    two-thirds of its compute.

    Each epoch: the indices are shuffled (torch's generator seeded with `seed + epoch`), cut into pools of
    `pool_batches` batches, each pool sorted by length and cut into batches, and the batches shuffled again, so
    lengths vary from step to step while each batch is nearly unpadded. The last batch may be short. A batch
    sampler for `DataLoader(batch_sampler=...)`; accelerate's `set_epoch` and `skip_first_batches` drive it (it
    is its own `sampler`, where accelerate looks for `set_epoch` behind its wrappers), so a resumed run sees the
    same batches. Written here because neither torch nor accelerate ships a length-bucketing batch sampler
    (transformers' `group_by_length` lives inside its Trainer)."""

    def __init__(self, lengths, batch_size: int, seed: int, pool_batches: int = 50):
        if batch_size < 1 or pool_batches < 1:
            raise ValueError(f"batch_size={batch_size} and pool_batches={pool_batches} must be >= 1")
        self.lengths, self.batch_size, self.seed, self.pool_batches = list(lengths), batch_size, seed, pool_batches
        self.drop_last = False
        self.epoch = 0
        self.sampler = self

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-len(self.lengths) // self.batch_size)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        pool = self.batch_size * self.pool_batches
        batches = []
        for start in range(0, len(order), pool):
            chunk = sorted(order[start : start + pool], key=lambda i: self.lengths[i])  # stable: ties keep order
            batches += [chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
        for index in torch.randperm(len(batches), generator=generator).tolist():
            yield batches[index]
