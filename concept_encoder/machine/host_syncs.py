"""Counting host-device synchronisations: the calls after which the host waits for the accelerator.

A CUDA step is fast only while the host queues kernels ahead of the GPU. Any call whose result the host
needs (a value read, a size that depends on the data, a blocking copy) drains the queue and leaves the
GPU idle until the host has queued the next kernels: at the `base` preset's one or two milliseconds of math
per step that idle time is most of the step. `HostSyncCounter` counts such calls by name, so a test on the
CPU holds the training step to its budget (none in a micro-batch, one per optimizer step) and
`benchmarks/host_syncs.py` reports the same counts on any machine.

What is counted (on tensors of `device_type`, the accelerator's; on a CPU run the CPU stands in for it):

- `aten._local_scalar_dense` (`.item()`, `bool()`, `float()`, `int()` of a tensor), `aten.is_nonzero`,
  `aten.equal`;
- `aten.nonzero` and `aten.masked_select` (their output size depends on the data);
- `aten.index` / `aten.index_put` with a boolean index (`x[mask]`, `x[mask] = v`): on a GPU they run
  `nonzero` inside their kernel and appear under no other name;
- a blocking copy between the host and the device (`.to(device)` of a CPU tensor, `.cpu()` of a device
  tensor, without `non_blocking=True`): torch waits for the stream after such a copy;
- `Tensor.tolist()`, `.numpy()`, `.cpu()` of a `device_type` tensor and `torch.tensor(...)`/`as_tensor(...)`
  made on a device: host reads and copies that never reach the dispatcher on the CPU (counted once each,
  not again for the copy inside them).

Counted by name, not timed: on the CPU nothing waits, and on a GPU a sync's cost depends on the queue.
"""

from __future__ import annotations

import collections

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.nonzero, aten.masked_select}
BOOLEAN_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
COPY_OPS = {aten._to_copy, aten.copy_}
HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}
DEVICE_FACTORIES = {torch.tensor, torch.as_tensor}


def device_type_of(value) -> str | None:
    return value.device.type if isinstance(value, torch.Tensor) else None


class HostSyncCounter(TorchDispatchMode):
    """Counts host syncs on tensors of `device_type` while entered (`with HostSyncCounter("cuda") as c:`);
    `c.total` is their number, `c.counts` by name."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self.counts: collections.Counter[str] = collections.Counter()
        self.depth = 0  # > 0 inside a counted host read: the copy inside it is the same sync
        self.reads = _HostReads(self)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self):
        self.reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.reads.__exit__(*exc)

    def count(self, name: str) -> None:
        if not self.depth:
            self.counts[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if name := self.sync_name(func, args, kwargs):
            self.count(name)
        return func(*args, **kwargs)

    def sync_name(self, func, args, kwargs) -> str | None:
        """The name `func(*args, **kwargs)` is counted under, or None when it does not sync."""
        packet = func.overloadpacket
        first = device_type_of(args[0]) if args else None
        if packet in SYNC_OPS:
            return packet.__name__ if first == self.device_type else None
        if packet in BOOLEAN_INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            boolean = any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
            return f"{packet.__name__} (boolean index)" if boolean and first == self.device_type else None
        if packet in COPY_OPS and self.device_type != "cpu":
            if packet is aten._to_copy:
                source, target = first, getattr(kwargs.get("device"), "type", first)
                blocking = not kwargs.get("non_blocking", False)
            else:
                target, source = first, device_type_of(args[1])
                blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            crossing = {source, target} == {"cpu", self.device_type}
            return f"{packet.__name__} ({source} to {target})" if crossing and blocking else None
        return None


class _HostReads(TorchFunctionMode):
    """The host reads of `HostSyncCounter` that never reach the dispatcher on the CPU (see the module doc)."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        name = None
        if func in HOST_READS and args and device_type_of(args[0]) == counter.device_type:
            name = f"Tensor.{func.__name__}"
        elif func in DEVICE_FACTORIES and counter.device_type != "cpu":
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == counter.device_type:
                name = f"torch.{func.__name__} (host data to {counter.device_type})"
        if name is None:
            return func(*args, **kwargs)
        counter.count(name)
        counter.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            counter.depth -= 1


def count_host_syncs(fn, *args, device_type: str = "cpu", **kwargs) -> tuple[object, HostSyncCounter]:
    """`fn(*args, **kwargs)` under a `HostSyncCounter(device_type)`: (its result, the counter)."""
    with HostSyncCounter(device_type) as counter:
        result = fn(*args, **kwargs)
    return result, counter
