"""What a run's Accelerator holds, seen plainly: the model without its wrappers (`plain_model`), the DeepSpeed
config it runs under (`deepspeed_config`), and a way to build a plain model on one process while ZeRO-3 is active
(`outside_zero3`). Shared by the loop's steps and by export, which checks a saved model with the run's own
accelerator."""

from __future__ import annotations

import contextlib

from accelerate.utils import DistributedType


def plain_model(accelerator, model):
    """The model `prepare` wrapped (DDP, DeepSpeed) and `maybe_compile` compiled, as its own class:
    what `save_pretrained`, `from_pretrained` of its type and parameter walks need."""
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def deepspeed_config(accelerator) -> dict | None:
    """The ds config the accelerator's DeepSpeed plugin runs under; None without DeepSpeed."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    return accelerator.state.deepspeed_plugin.deepspeed_config


@contextlib.contextmanager
def outside_zero3():
    """Load a model on one process as a plain model while a ZeRO-3 run is active.

    Under ZeRO-3, `from_pretrained` partitions new models across ranks (a collective); a
    single-rank reload inside that context would wait for ranks that never come.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved
