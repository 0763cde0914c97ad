"""The training batches of both loops: windows of micro-batches, epoch after epoch, resumable exactly."""

from __future__ import annotations

import itertools

import torch
from accelerate import skip_first_batches


def accumulation_windows(loader, accumulation: int, state, finish_batch):
    """Yield lists of `accumulation` micro-batches forever, epoch after epoch, resuming at `state`.

    `finish_batch` (masking + device placement) runs as a window is handed out, not when the
    DataLoader prefetches, so masking randomness is drawn only for batches that are trained on.
    An incomplete window at the end of an epoch is dropped, so every optimizer step sees the
    same number of micro-batches. `state.epoch` / `state.batches_in_epoch` (a `TrainState`) track the
    position; with accelerate's seedable sampler, `set_epoch` makes each epoch's order reproducible.
    """
    while True:
        loader.set_epoch(state.epoch)
        source = skip_first_batches(loader, state.batches_in_epoch) if state.batches_in_epoch else loader
        iterator = iter(source)
        produced = False
        while len(window := list(itertools.islice(iterator, accumulation))) == accumulation:
            produced = True
            state.batches_in_epoch += accumulation
            yield [finish_batch(batch) for batch in window]
        if not produced and state.batches_in_epoch == 0:
            raise ValueError(
                "the training set is too small for one optimizer step: lower per_device_train_batch_size "
                "or gradient_accumulation_steps, or use more data (with --streaming, the first "
                "--streaming_validation_documents documents are held out for validation)"
            )
        state.epoch += 1
        state.batches_in_epoch = 0


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
