"""What this machine must have for what a launch asks, checked before anything is built (`preflight`, the plan
checker, the ZeRO comparison): a torch that can use the GPU the NVIDIA driver sees, for NVMe offload libaio and the
CUDA toolkit, and the host RAM (`host_memory_bytes`).

Torch-free: the checks read `nvidia-smi`, compile a few lines of C and look for `nvcc`; torch is imported only
to describe a GPU torch cannot use, which happens in the loop (torch already loaded), never in `fail_fast`.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

from ..accounting.memory import nvme_offloaded

DEFAULT_CUDA_HOME = "/usr/local/cuda"  # torch.utils.cpp_extension's last guess
TORCH_INDEX = "https://download.pytorch.org/whl"


class DriverGpu(NamedTuple):
    """What `nvidia-smi` reports about the driver of a GPU it sees (None: not in its output)."""

    driver: str | None
    cuda: str | None  # the newest CUDA this driver runs


def driver_gpu() -> DriverGpu | None:
    """The NVIDIA driver's versions when `nvidia-smi` sees a GPU, else None: no `nvidia-smi` on PATH (no driver
    installed), or one that fails (exit code not 0: no device, or it "couldn't communicate with the NVIDIA driver";
    a GPU the driver cannot run is no GPU that torch could use)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    found = [re.search(rf"{name} Version:\s*([\w.-]+)", out.stdout) for name in ("Driver", "CUDA")]
    return DriverGpu(*(match.group(1) if match else None for match in found))


def unseen_gpu_problem() -> str | None:
    """A line when the NVIDIA driver sees a GPU but torch cannot use it (a CPU wheel, or a wheel built for a newer
    CUDA than the driver runs), so the run would quietly train on the CPU, many times slower; None otherwise,
    and when the CPU is chosen on purpose (`CUDA_VISIBLE_DEVICES` empty or -1, `accelerate launch --cpu`). The
    caller skips it under `--allow_cpu` and where the run already has a GPU."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
    if hidden or chosen_cpu() or (gpu := driver_gpu()) is None:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    seen = f"nvidia-smi: driver {gpu.driver or '?'}, CUDA {gpu.cuda or '?'}"
    built = torch.version.cuda
    index = f"{TORCH_INDEX}/cu{''.join(gpu.cuda.split('.')[:2])}" if gpu.cuda else f"{TORCH_INDEX}/cu<XY>"
    fix = (
        f"install a torch wheel built for {f'CUDA {gpu.cuda}' if gpu.cuda else 'the CUDA the driver runs'} or older "
        f"(pip install torch --index-url {index}, or an older cuXY index pytorch.org lists)"
    )
    if built is None:
        why = "a CPU-only wheel: torch.version.cuda is None"
    elif gpu.cuda and version_tuple(built) > version_tuple(gpu.cuda):
        why = f"built for CUDA {built}, newer than the CUDA {gpu.cuda} this driver runs"
    else:  # a wheel the driver can run that still finds no GPU: the device files or the driver, not the wheel
        why = f"built for CUDA {built}, yet torch.cuda.is_available() is False"
        fix = "check that this process may open /dev/nvidia* and that the driver loads (torch's warning says more)"
    return (
        f"the NVIDIA driver sees a GPU ({seen}) but torch {torch.__version__} cannot use it ({why}), so this run "
        f"would train on the CPU; {fix}, or pass --allow_cpu to train on the CPU anyway"
    )


def host_memory_bytes(field: str = "MemAvailable") -> int | None:
    """This machine's RAM from /proc/meminfo: `MemAvailable` (what new processes can take without swapping) or
    `MemTotal`; None where it cannot be read (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def chosen_cpu() -> bool:
    """Whether `accelerate launch --cpu` (or `use_cpu: true` in its config) started this process."""
    return os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def cuda_compiler() -> Path | None:
    """`nvcc` where torch's extension builder, and so DeepSpeed, looks for it (`torch.utils.cpp_extension.CUDA_HOME`):
    in `$CUDA_HOME` or `$CUDA_PATH`, else beside the `nvcc` on PATH, else in /usr/local/cuda; None when that
    toolkit has no runnable `bin/nvcc` (pip's torch wheels ship the CUDA runtime, not the compiler)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home is None:
        found = shutil.which("nvcc")
        home = str(Path(found).parent.parent) if found else DEFAULT_CUDA_HOME
    nvcc = Path(home) / "bin" / "nvcc"
    return nvcc if os.access(nvcc, os.X_OK) else None


LIBAIO_PROGRAM = "#include <libaio.h>\nint main(void) { io_context_t context = 0; return io_setup(1, &context); }\n"


LIBAIO_FIX = (
    "install libaio's development files (apt install libaio-dev; dnf install libaio-devel), or point CFLAGS/LDFLAGS "
    "at a libaio built from source"
)


def libaio_problem() -> tuple[str, str] | None:
    """(what is missing, how to install it) when DeepSpeed's async_io op (NVMe offload) cannot build against libaio,
    else None: its header, then its library, each found as DeepSpeed's own check finds them (a C program compiled,
    then linked with `-laio`, under `$CC`, `$CFLAGS` and `$LDFLAGS`); or no C compiler to tell."""
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0]:
        return "no C compiler (cc, gcc or $CC)", "install gcc (apt install build-essential)"
    with tempfile.TemporaryDirectory() as folder:
        source, obj = Path(folder) / "aio.c", Path(folder) / "aio.o"
        source.write_text(LIBAIO_PROGRAM)
        steps = (
            ("libaio's header (libaio.h)", [*shlex.split(os.environ.get("CFLAGS", "")), "-c", str(source), "-o", str(obj)]),
            ("libaio's library (libaio.so)", [str(obj), *shlex.split(os.environ.get("LDFLAGS", "")), "-laio", "-o", str(Path(folder) / "aio")]),
        )  # fmt: skip
        for what, arguments in steps:
            try:
                built = subprocess.run([*compiler, *arguments], capture_output=True, timeout=120).returncode == 0
            except (OSError, subprocess.SubprocessError):
                built = False
            if not built:
                return f"{what} is not found", LIBAIO_FIX
    return None


def prebuilt_op(name: str, accelerator: str) -> bool:
    """Whether the installed DeepSpeed was built with op `name` for `accelerator` (`DS_BUILD_AIO=1 pip install
    deepspeed`): then it loads without building. Read from its `git_version_info_installed.py`, not imported."""
    spec = importlib.util.find_spec("deepspeed")
    try:
        tree = ast.parse((Path(spec.origin).parent / "git_version_info_installed.py").read_text())
        values = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign) for t in n.targets}
    except (AttributeError, TypeError, OSError, SyntaxError, ValueError):
        return False  # no DeepSpeed, or a file of another shape: the op is built on first use
    return bool(values.get("installed_ops", {}).get(name)) and values.get("accelerator_name") == accelerator


def nvme_offload_problem(ds_config: dict | None, cuda: bool) -> tuple[str, str] | None:
    """(what is missing, how to install it) when `ds_config` offloads to NVMe and DeepSpeed's async_io op (its NVMe
    reads and writes) cannot be built here: libaio's header and library, and on a GPU machine (`cuda`) `nvcc`,
    since DeepSpeed builds it as a CUDA extension there. None without NVMe offload or with the op prebuilt."""
    if not nvme_offloaded(ds_config) or prebuilt_op("async_io", "cuda" if cuda else "cpu"):
        return None
    problems = [libaio_problem()]
    if cuda and cuda_compiler() is None:
        problems.append((
            "no CUDA compiler (nvcc in $CUDA_HOME/bin, on PATH or in /usr/local/cuda)",
            "install the CUDA toolkit of torch's CUDA version (torch.version.cuda) and set CUDA_HOME to it",
        ))  # fmt: skip
    if not (problems := [problem for problem in problems if problem]):
        return None
    missing, fixes = zip(*problems, strict=True)
    what = f"NVMe offload needs DeepSpeed's async_io op, which cannot be built here: {' and '.join(missing)}"
    return what, "; ".join(fixes)
