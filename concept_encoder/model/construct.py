"""A fresh model with seeded weights, built as the loop, export and the tests build it (`construct`)."""

from __future__ import annotations


def construct(model_class, config, seed: int, zero3_config: dict | None = None):
    """A fresh `model_class(config)`: the module tree built without initialising it, then every weight
    initialised (`initialize_weights`) from torch's generator seeded with `seed`, in a forked RNG state (the
    weights depend on the seed alone, not on what ran before, and the global RNG is left as it was).

    With `zero3_config` the tree is built under `deepspeed.zero.Init`: each module's parameters are
    partitioned across the ranks (or offloaded, `offload_param`) as soon as the module exists, so no process
    ever holds the whole model; transformers' `initialize_weights_zero3` then gathers one module at a time on
    rank 0 to initialise it. It runs the same initialisers in the same order, so on CPU both ways give equal
    weights (on CUDA the gathered weights draw from the GPU's generator)."""
    import contextlib

    import torch
    from transformers import initialization as init

    with contextlib.ExitStack() as stack:
        stack.enter_context(init.no_init_weights())
        if zero3_config is not None:
            import deepspeed

            stack.enter_context(deepspeed.zero.Init(config_dict_or_path=zero3_config))
        model = model_class(config)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        if zero3_config is None:
            model.initialize_weights()
        else:
            from transformers.integrations.deepspeed import initialize_weights_zero3

            initialize_weights_zero3(model)
    model.tie_weights()
    return model
