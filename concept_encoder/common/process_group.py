"""Child commands in their own process group, ended as a whole on timeout, error or Ctrl-C.

`accelerate launch` starts one training process per rank; killing only the launcher (what
`subprocess.run(..., timeout=...)` does) leaves the ranks orphaned, training on for as long as the
machine lives. Every multi-process launch of the tools and tests goes through here instead.
"""

from __future__ import annotations

import os
import signal
import subprocess


def start(command: list[str], **popen_kwargs) -> subprocess.Popen:
    """`Popen(command)` as the leader of a new process group (session)."""
    return subprocess.Popen(command, start_new_session=True, **popen_kwargs)


def end_group(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to every process of `process`'s group and reap the leader."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
    process.wait()


def finish(process: subprocess.Popen, timeout: float | None) -> tuple[int, str | None, str | None]:
    """Wait for the leader (reading its pipes); on timeout or any interruption end the whole group.

    Returns `(returncode, stdout, stderr)`; raises `subprocess.TimeoutExpired` after ending the group.
    """
    try:
        out, err = process.communicate(timeout=timeout)
    except BaseException:  # TimeoutExpired, KeyboardInterrupt, a failing test: leave nothing running
        end_group(process)
        raise
    end_group(process)  # ranks the launcher left behind, if any
    return process.returncode, out, err


def run(command: list[str], timeout: float | None, **popen_kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run` with the whole process group ended on timeout (text output captured)."""
    process = start(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs)
    code, out, err = finish(process, timeout)
    return subprocess.CompletedProcess(command, code, out, err)


def call_interrupting_ranks(command: list[str], grace: float = 600.0) -> int:
    """Run a launch (`accelerate launch ...`) to its end and return its exit code, as `subprocess.call` would.

    Ctrl-C reaches only the calling tool: the launch runs in its own session. The tool then passes the interrupt
    to the processes the launcher started (the loops' ranks stop as they do on a signal: a checkpoint, then exit),
    not to the launcher itself (torch's launcher answers a signal with a traceback), waits up to `grace` seconds
    for the launch to end (then ends its whole group) and raises KeyboardInterrupt for the tool to report."""
    import psutil

    process = start(command)
    try:
        return process.wait()
    except KeyboardInterrupt:
        try:
            ranks = psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            ranks = []
        for rank in ranks:
            try:
                rank.send_signal(signal.SIGINT)
            except psutil.NoSuchProcess:
                pass
        try:
            process.wait(timeout=grace if ranks else 0.1)
        except subprocess.TimeoutExpired:
            pass
        end_group(process)  # whatever is left (a launcher that started nothing yet)
        raise
