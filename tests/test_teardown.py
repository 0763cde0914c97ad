"""`runtime.finish_distributed`, the last step of every loop: ZeRO-3's in-flight gathers drained, every rank met,
trackers finished, the process group destroyed, in that order, so no communication object is left for the
interpreter's shutdown (where freeing it aborted a rank after its work was done)."""

import torch
from torch import nn

from concept_encoder.training import runtime


class Recorder:
    def __init__(self, calls, trackers=True):
        self.calls = calls
        if trackers:
            self.end_training = lambda: calls.append("end_training")

    def wait_for_everyone(self):
        self.calls.append("wait_for_everyone")


class Engine(nn.Module):
    """What a DeepSpeed engine offers for the drain: `empty_partition_cache`."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def empty_partition_cache(self):
        self.calls.append("empty_partition_cache")


def test_an_engine_is_drained_before_the_ranks_meet_and_the_group_ends():
    calls = []
    runtime.finish_distributed(Recorder(calls), Engine(calls))
    assert calls == ["empty_partition_cache", "wait_for_everyone", "end_training"]


def test_a_plain_module_has_nothing_in_flight():
    calls = []
    runtime.finish_distributed(Recorder(calls), nn.Linear(2, 2))
    assert calls == ["wait_for_everyone", "end_training"]


def test_a_loop_without_an_accelerator_destroys_the_process_group_itself(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: calls.append("destroy_process_group"))
    runtime.finish_distributed(Recorder(calls, trackers=False))
    assert calls == ["wait_for_everyone", "destroy_process_group"]
    calls.clear()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # one process: no group to destroy
    runtime.finish_distributed(Recorder(calls, trackers=False))
    assert calls == ["wait_for_everyone"]


def test_both_loops_end_with_it():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for loop in ("mlm.py", "finetune.py"):
        text = (root / "loops" / loop).read_text()
        assert "finish_distributed(" in text and "end_training()" not in text, loop
