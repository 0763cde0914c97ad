"""The training batches of both loops: windows of micro-batches, epoch after epoch, resumable exactly."""

from __future__ import annotations

import itertools

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
