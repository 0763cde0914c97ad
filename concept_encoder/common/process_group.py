"""Child commands in their own process group, ended as a whole on timeout, error or Ctrl-C.

`accelerate launch` starts one training process per rank; killing only the launcher (what
`subprocess.run(..., timeout=...)` does) leaves the ranks orphaned, training on for as long as the
machine lives. Every multi-process launch of the tools and tests goes through here instead.

A group is not the whole tree: a tool started here that starts launches of its own (`launch/zero_compare.py`
under `benchmarks/gpu_check.py`) puts each in a session of its own, which `killpg` on the tool's group misses, and
which outlives it holding GPU and pinned host memory. So `start` also tags the child's environment (`TREES`), which
every descendant inherits, and `end_group` ends every process carrying the tag, wherever it is.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

from .entry import Terminated

TREES = "CONCEPT_ENCODER_PROCESS_TREES"  # the tags of the `start`s a process descends from, space-separated


def start(command: list[str], **popen_kwargs) -> subprocess.Popen:
    """`Popen(command)` as the leader of a new process group (session), its environment (`env`, or this
    process's) tagged with a new `TREES` tag so that `tree` finds its descendants in other sessions too."""
    tag = uuid.uuid4().hex
    env = popen_kwargs.pop("env", None)
    env = dict(os.environ if env is None else env)
    env[TREES] = f"{env.get(TREES, '')} {tag}".strip()
    process = subprocess.Popen(command, start_new_session=True, env=env, **popen_kwargs)
    process.tree_tag = tag
    return process


def tree(process: subprocess.Popen) -> list:
    """The living processes (`psutil.Process`) of `process`'s tree, itself included: those whose environment
    carries its tag, also after they started sessions of their own or lost their parent. (A descendant that
    replaced its whole environment is not found; none of the project's launchers does.)"""
    import psutil

    tag, found = getattr(process, "tree_tag", None), []
    if tag is None:
        return found
    for candidate in psutil.process_iter():
        try:
            if candidate.pid != os.getpid() and tag in candidate.environ().get(TREES, "").split():
                found.append(candidate)
        except psutil.Error:  # gone, a zombie, or another user's
            pass
    return found


def end_group(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to every process of `process`'s group and of its tree (`tree`), and reap the leader. With
    SIGKILL, until none is left: a descendant forked between a look and the kill is found by the next look."""
    import psutil

    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
    for _ in range(50 if sig == signal.SIGKILL else 1):
        left = tree(process)
        for member in left:
            try:
                member.send_signal(sig)
            except psutil.Error:
                pass
        if not left:
            break
        time.sleep(0.02)  # SIGKILL takes effect asynchronously: a member may still be there at the next look
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
    for the launch to end (then ends its whole group) and raises KeyboardInterrupt for the tool to report. SIGTERM
    to the tool (`kill`, `timeout`) does the same and raises `entry.Terminated`: by default it would end the tool
    alone and leave the launch, in its own session, training on. A stop while the launch starts is held until it
    is in hand (`HeldStops`). Called from a worker thread of `run_at_once` (signals reach the main thread only),
    the launch is that pool's to stop. The launch's standard error is relayed as it comes (`relay_stderr`; beside
    the pool's other launches, or when the tool's standard error is not a terminal, in whole lines)."""
    import psutil  # noqa: F401 (imported now, not in the instant after a Ctrl-C: `interrupt_ranks`)

    in_main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    pool = None if in_main_thread else RUNNING.pool
    stops = HeldStops()
    previous = stops.install() if in_main_thread else {}
    process, interrupted = None, threading.Event()
    try:
        if pool is None:
            process = start(command, stderr=subprocess.PIPE)
        else:
            process = pool.start(command, interrupted, stderr=subprocess.PIPE)
        in_lines = pool is not None or not sys.stderr.isatty()  # beside other launches, or into a log file
        relay = threading.Thread(target=relay_stderr, args=(process.stderr, interrupted, in_lines), daemon=True)
        relay.start()
        stops.release()  # a stop that came while the launch started is raised here, with the launch in hand
        code = process.wait()
        relay.join()
        return code
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM as `Terminated`
        if process is None:  # nothing started: nothing to stop
            raise
        interrupted.set()
        stop_launches(lambda: interrupt_ranks([process]), previous, grace)
        relay.join(timeout=5)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler or signal.SIG_DFL)  # None: not set from Python
        if pool is not None and process is not None:
            pool.ended(process)


def interrupt_ranks(processes: list[subprocess.Popen]) -> dict:
    """SIGINT to the processes each running launch started (its ranks stop at a checkpoint), not to the launchers;
    a launch that has ended gets none (its pid's children may be another process's by now). Returns `{launch:
    ranks}` for `wait_for_launches`."""
    import psutil

    ranks = {}
    for process in processes:
        if process.poll() is not None:
            ranks[process] = []  # ended: only what it left behind is ended (`end_group` finds it by its tag)
            continue
        try:
            ranks[process] = psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            ranks[process] = []
        for rank in ranks[process]:
            try:
                rank.send_signal(signal.SIGINT)
            except psutil.NoSuchProcess:
                pass
    return ranks


def stop_launches(interrupt, previous: dict, grace: float) -> None:
    """After a stop: `interrupt()` (SIGINT to the launches' ranks, `{launch: ranks}` back) with every stop signal of
    `previous` (the handlers replaced) ignored, so a second one cannot cut in before every rank has its SIGINT; then
    a second Ctrl-C does what it did before the call while the ranks checkpoint (`wait_for_launches`), and a second
    SIGTERM stays ignored: it must not cut the checkpoints."""
    for sig in previous:
        signal.signal(sig, signal.SIG_IGN)
    ranks = interrupt()
    if signal.SIGINT in previous:
        signal.signal(signal.SIGINT, previous[signal.SIGINT] or signal.SIG_DFL)
    wait_for_launches(ranks, grace)


# While a stopped launch has not ended, its ranks get SIGINT again this often: a rank that had not yet installed its
# handler when the first came (still importing, or between two fine-tuning seeds) ignored it where SIGINT is
# ignored (a tool run by `nohup ... &`: the ranks inherit that) and would train on until `grace` ran out and the
# launch was killed, its steps since the last checkpoint lost; a rank already stopping logs the repeat and goes on
RESEND_EVERY = 5.0


def wait_for_launches(ranks: dict, grace: float) -> None:
    """Up to `grace` seconds, for all of them together, for the launches `interrupt_ranks` signalled to end (their
    ranks signalled again every `RESEND_EVERY` seconds while they run); then whatever is left of each is ended
    (`end_group`)."""
    deadline = time.monotonic() + grace
    for process, started in ranks.items():
        while True:
            try:  # a launcher that had started nothing is given a moment only
                process.wait(timeout=max(0.0, min(RESEND_EVERY, deadline - time.monotonic())) if started else 0.1)
                break
            except subprocess.TimeoutExpired:
                if not started or time.monotonic() >= deadline:
                    break
                interrupt_ranks([process])  # again, to the ranks it runs now
        end_group(process)  # whatever is left (a launcher that started nothing yet)


class LaunchPool:
    """The launches `call_interrupting_ranks` waits on in `run_at_once`'s worker threads, which the main thread
    stops together (`interrupt`); once it has, no launch starts."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()
        self.active: set[subprocess.Popen] = set()
        self.relays: dict[subprocess.Popen, object] = {}  # a launch's relay's `interrupted` event
        self.closed = False

    def start(self, command: list[str], interrupted, **popen_kwargs) -> subprocess.Popen:
        """`start(command)`, kept with its relay's `interrupted` event (set by `interrupt`: after it only the loops'
        own lines are relayed); KeyboardInterrupt once the pool was stopped."""
        with self.lock:  # never a launch the main thread's `interrupt` misses
            if self.closed:
                raise KeyboardInterrupt
            process = start(command, **popen_kwargs)
            self.active.add(process)
            self.relays[process] = interrupted
            return process

    def ended(self, process: subprocess.Popen) -> None:
        with self.lock:
            self.active.discard(process)
            self.relays.pop(process, None)

    def interrupt(self) -> dict:
        """SIGINT to every running launch's ranks (`interrupt_ranks`; `wait_for_launches` takes what it returns);
        no launch starts after."""
        with self.lock:
            self.closed = True
            processes = list(self.active)
            for process in processes:
                if event := self.relays.get(process):
                    event.set()  # after the interrupt, only the loops' own lines are relayed
        return interrupt_ranks(processes)


class Running:
    """The `LaunchPool` of the `run_at_once` running now (its worker threads read it), or None."""

    pool: LaunchPool | None = None


RUNNING = Running()


def run_at_once(jobs: list, workers: int, grace: float = 600.0) -> list:
    """`jobs` (callables, each waiting on launches through `call_interrupting_ranks`) run `workers` at a time, in
    threads; their results in `jobs`' order. One worker: each in turn, in this thread. Ctrl-C or SIGTERM (as
    `entry.Terminated`) stops every running launch at a checkpoint, starts no more job, and is raised; a job's
    error lets the running ones finish, starts no more, and is raised (the first, in `jobs`' order, the others'
    messages added to it as notes, shown under its own)."""
    if workers <= 1 or len(jobs) <= 1:
        return [job() for job in jobs]
    from concurrent.futures import CancelledError, ThreadPoolExecutor, wait

    import psutil  # noqa: F401 (imported now: not in the instant after a Ctrl-C)

    stops, pool, failed = HeldStops(), LaunchPool(), threading.Event()
    terminal = sys.stdout
    lines = WholeLines(terminal)  # the jobs' own prints, a whole line at a time

    def guarded(job):
        if failed.is_set():  # set by the job that failed, before its worker takes the next one
            raise CancelledError
        try:
            return job()
        except BaseException:
            failed.set()
            raise
        finally:
            lines.end_line()  # a last print without its newline

    previous = stops.install()
    executor, futures = None, []
    try:
        stops.release()  # no launch is this thread's: a stop is raised at once
        RUNNING.pool = pool
        sys.stdout = lines
        executor = ThreadPoolExecutor(max_workers=workers)
        futures += [executor.submit(guarded, job) for job in jobs]
        for future in futures:
            if (error := future.exception()) is not None and not isinstance(error, CancelledError):
                for other in futures:
                    other.cancel()  # the queued ones; the running ones finish
                wait(futures)
                for other in failures(futures):
                    if other is not error:  # shown with the first: one rerun mends them all
                        error.add_note(f"another job failed too: {type(other).__name__}: {other}")
                raise error  # the first error, in `jobs`' order
        return [future.result() for future in futures]
    except KeyboardInterrupt:
        for future in futures:
            future.cancel()
        stop_launches(pool.interrupt, previous, grace)
        raise
    finally:
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        sys.stdout = terminal
        RUNNING.pool = None
        for sig, handler in previous.items():
            signal.signal(sig, handler or signal.SIG_DFL)


class WholeLines:
    """Standard output shared by `run_at_once`'s threads, written a whole line at a time under `RELAY_LOCK`.

    Why: `print(text)` writes `text` and its newline in two calls, so two threads printing at once interleave
    (`cell A: reusedcell B: reused`, then two newlines), and a launch's relayed lines (`relay_stderr`) can fall
    between them. Each thread's text is held until its newline; other attributes are the wrapped stream's."""

    def __init__(self, stream):
        self.stream = stream
        self.held = threading.local()

    def write(self, text: str) -> int:
        *lines, self.held.text = (getattr(self.held, "text", "") + text).split("\n")
        if lines:
            with RELAY_LOCK:
                self.stream.write("".join(line + "\n" for line in lines))
                self.stream.flush()
        return len(text)

    def end_line(self) -> None:
        """Write this thread's held text, ended by a newline (a job's last print without one)."""
        if getattr(self.held, "text", ""):
            self.write("\n")

    def flush(self) -> None:
        """Nothing to do: only whole lines are written, each flushed."""

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def failures(futures: list) -> list[BaseException]:
    """The errors finished `futures` raised, in their order (a cancelled or successful one has none)."""
    from concurrent.futures import CancelledError

    return [error for future in futures if not future.cancelled() and (error := future.exception()) is not None
            and not isinstance(error, CancelledError)]  # fmt: skip


class HeldStops:
    """Ctrl-C (SIGINT) and SIGTERM while a tool starts a launch and waits on it (`call_interrupting_ranks`): one
    that comes before the launch is in hand (`subprocess.Popen` returned, the relay running) is held and raised by
    `release`, so no instant is left in which a stop ends the tool and leaves the launch, in a session of its own,
    training on. Raised as KeyboardInterrupt, SIGTERM as `entry.Terminated`."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.released = False
        self.held: KeyboardInterrupt | None = None

    def install(self) -> dict:
        """Handle `SIGNALS` from now on (main thread only), but for one the process ignores (SIGINT in a background
        job started without job control, `nohup ... &`); returns the handlers replaced."""
        return {sig: signal.signal(sig, self.handle) for sig in self.SIGNALS if signal.getsignal(sig) != signal.SIG_IGN}

    def handle(self, signum, frame) -> None:
        stop = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        if self.released:
            raise stop
        self.held = self.held or stop

    def release(self) -> None:
        """From now on a stop is raised at once; one held since `install` is raised now."""
        self.released = True
        if self.held is not None:
            raise self.held


# After an interrupt: the loops' own lines (their one-line stop, an error line, their log records) go on
LOOP_LINES = re.compile(rb"^(\S+: interrupted\b|error: |\S+ \S+ (INFO|WARNING|ERROR) concept_encoder)")


PROGRESS_EVERY = 30.0  # seconds between a launch's progress-bar lines when several launches share one terminal
RELAY_LOCK = threading.Lock()  # one launch's lines at a time on the shared terminal


def relay_stderr(stream, interrupted, in_lines: bool = False) -> None:
    """Copy a launch's standard error (its ranks write there too) to this process's, as it comes (progress bars
    included). Once the tool was interrupted only the loops' own lines pass (`LOOP_LINES`): the launcher's report
    of ranks that ended by the interrupt (torch's multi-process launcher prints a traceback and a FAILED table for
    ranks stopped before training) is not an error of the user's. `in_lines` (a launch beside others,
    `run_at_once`'s, or a tool writing to a log file) relays whole lines, one launch's at a time, and the progress
    bar (redrawn in place, ended by a carriage return) as one line every `PROGRESS_EVERY` seconds: two bars
    redrawn in place on one terminal overwrite each other and their pieces interleave, and in a file every redraw
    stays (a map's log under `nohup` grew by some 8 bar redraws a second)."""
    out = getattr(sys.stderr, "buffer", None)

    def write(data: bytes) -> None:
        if not data:
            return
        with RELAY_LOCK:
            if out is not None:
                out.write(data)
                out.flush()
            else:
                sys.stderr.write(data.decode(errors="replace"))

    pending, last_bar = b"", None
    while chunk := os.read(stream.fileno(), 65536):
        if not in_lines and not interrupted.is_set():
            write(chunk)
            continue
        *pieces, pending = re.split(rb"([\r\n])", pending + chunk)
        lines = []
        for text, end in zip(pieces[::2], pieces[1::2], strict=True):
            if interrupted.is_set():
                keep = end == b"\n" and LOOP_LINES.match(text)
            elif end == b"\r":  # a progress bar's redraw: one every PROGRESS_EVERY seconds
                keep = text.strip() and (last_bar is None or time.monotonic() - last_bar >= PROGRESS_EVERY)
                last_bar = time.monotonic() if keep else last_bar
            else:
                keep = text.strip()
            if keep:
                lines.append(text + b"\n")
        write(b"".join(lines))
    if in_lines and not interrupted.is_set() and pending.strip():
        write(pending + b"\n")  # a last line without its newline
