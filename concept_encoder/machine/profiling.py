"""`--profile_steps a:b`: a `torch.profiler` trace of optimizer steps a..b (1-based) of a training run.

The main process records CPU activity (and CUDA kernels on a GPU) with shapes, stacks off, and writes
`<run>/profile/trace_step<a>-<b>.json` (Chrome trace format: ui.perfetto.dev or chrome://tracing open it) and
`<run>/profile/ops.txt`, the 20 operators with the most self time (device time on a GPU, CPU time otherwise),
which it also logs. torch's own `schedule` decides when to record; the loop steps it once per optimizer step.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..common.paths import folder_problem

logger = logging.getLogger("concept_encoder")
OP_ROWS = 20


def resumed_range(steps: tuple[int, int], done: int) -> bool:
    """Whether any of the `--profile_steps` range is left to record after `done` steps (a resume's step), saying so
    in one line when a resume skips all or part of it: a range silently not recorded looks like a broken profiler."""
    first, last = steps
    if last <= done:
        logger.warning("--profile_steps %d:%d was trained before this resume (at step %d): nothing is profiled; give "
                       "a range after step %d to profile this run", first, last, done, done)  # fmt: skip
        return False
    if first <= done:
        logger.info("--profile_steps %d:%d resumed at step %d: profiling steps %d-%d, the rest of the range",
                    first, last, done, done + 1, last)  # fmt: skip
    return True


class StepProfiler:
    """A `torch.profiler.profile` over optimizer steps `first..last` (the `--profile_steps` range; None: off).

    Built before the loop (`done`: the steps already trained, a resume's step), stepped with the steps done at the
    top of every loop iteration, stopped after the loop: the interval of step s is then its whole iteration
    (training step, logging, evaluation, checkpoint). A resumed run records what is left of the range; a run that
    stops inside it (preemption, a gate) writes the steps it recorded. Other processes record nothing.
    """

    def __init__(self, steps: tuple[int, int] | None, run_dir: Path, main_process: bool, done: int = 0):
        self.profiler = None
        self.done_at_start = done
        if steps is None or not main_process or not resumed_range(steps, done):
            return
        self.first, self.last = max(steps[0], done + 1), steps[1]
        self.folder = Path(run_dir) / "profile"
        if problem := folder_problem(self.folder, "--profile_steps: the profile folder"):
            raise ValueError(f"{problem}; free that path or choose another --output_dir")  # before the steps train
        self.cuda = torch.cuda.is_available()
        warmup = min(1, self.first - done - 1)  # one step to settle the profiler's start-up, where there is one
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=self.first - done - 1 - warmup, warmup=warmup, active=self.last - self.first + 1, repeat=1
            ),
            on_trace_ready=self.write,
            record_shapes=True,
            with_stack=False,
        )
        self.profiler.start()
        self.recorded_to = self.last  # the last step in the trace: `write` names the file by it

    def step(self, done: int) -> None:
        """Call at the top of each loop iteration with the optimizer steps done so far."""
        if self.profiler is not None and done > self.done_at_start:
            self.recorded_to = min(done, self.last)
            self.profiler.step()

    def stop(self, done: int) -> None:
        """After the loop, with the steps done: closes the last interval (writing the trace if it was recording)."""
        if self.profiler is not None:
            self.recorded_to = min(done, self.last)
            self.profiler.stop()
            self.profiler = None

    def write(self, profiler) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"trace_step{self.first}-{self.recorded_to}.json"
        profiler.export_chrome_trace(str(trace))
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort, row_limit=OP_ROWS)
        (self.folder / "ops.txt").write_text(table + "\n")
        logger.info("profile of steps %d-%d: %s (open in ui.perfetto.dev); operators by %s:\n%s", self.first,
                    self.recorded_to, trace, sort, table)  # fmt: skip
