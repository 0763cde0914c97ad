"""What the machine must have for what a launch asks, refused in one line before anything is built: a GPU the
driver sees that torch cannot use (unless --allow_cpu), --torch_compile under ZeRO-3, NVMe offload without libaio
or nvcc, DeepSpeed ops that do not build (`launch/build_ops.py`); and the CPU-thread policy on GPU machines."""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import launch.build_ops as build_ops
import launch.check_plan as check_plan
from concept_encoder.machine import checks as machine_checks
from concept_encoder.training import runtime
from concept_encoder.training.args import parse_args
from concept_encoder.training.plan import zero3_compile_problem
from concept_encoder.training.preflight import fail_fast, preflight

ROOT = Path(__file__).resolve().parents[1]
NVIDIA_SMI = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
|   0  NVIDIA GeForce RTX 3080        Off |   00000000:01:00.0  On |                  N/A |
"""
UNREACHABLE = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."


def fake_nvidia_smi(monkeypatch, returncode: int = 0, stdout: str = NVIDIA_SMI, present: bool = True) -> None:
    """`nvidia-smi` on PATH (or not) answering `stdout` with `returncode`; torch without CUDA."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(machine_checks.shutil, "which", lambda name: f"/usr/bin/{name}" if present else None)

    def run(command, **kwargs):
        assert command == ["nvidia-smi"]
        return subprocess.CompletedProcess(command, returncode, stdout=stdout, stderr="")

    monkeypatch.setattr(machine_checks.subprocess, "run", run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize(
    ("built_for", "why", "fix"),
    [
        (None, "(a CPU-only wheel: torch.version.cuda is None)", "--index-url https://download.pytorch.org/whl/cu124"),
        ("12.8", "(built for CUDA 12.8, newer than the CUDA 12.4 this driver runs)", "built for CUDA 12.4 or older"),
        ("12.1", "(built for CUDA 12.1, yet torch.cuda.is_available() is False)", "may open /dev/nvidia*"),
    ],
    ids=["cpu-wheel", "newer-cuda", "matching-wheel"],
)
def test_a_gpu_the_driver_sees_but_torch_cannot_use_is_refused_naming_both_and_the_fix(
    monkeypatch, built_for, why, fix
):
    fake_nvidia_smi(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", built_for)
    problem = machine_checks.unseen_gpu_problem()
    assert problem.startswith("the NVIDIA driver sees a GPU (nvidia-smi: driver 550.54.15, CUDA 12.4) but torch ")
    assert f"{torch.__version__} cannot use it {why}, so this run would train on the CPU; " in problem
    assert fix in problem and problem.endswith(", or pass --allow_cpu to train on the CPU anyway")
    assert "\n" not in problem


@pytest.mark.parametrize(
    "machine", ["no-nvidia-smi", "driver-unreachable", "torch-has-cuda", "gpus-hidden", "accelerate-cpu"]
)
def test_no_refusal_without_a_gpu_torch_could_use_or_when_the_cpu_is_chosen(monkeypatch, machine):
    fake_nvidia_smi(
        monkeypatch,
        present=machine != "no-nvidia-smi",
        returncode=9 if machine == "driver-unreachable" else 0,
        stdout=UNREACHABLE if machine == "driver-unreachable" else NVIDIA_SMI,
    )
    if machine == "torch-has-cuda":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if machine == "gpus-hidden":
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    if machine == "accelerate-cpu":
        monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    assert machine_checks.unseen_gpu_problem() is None


def test_the_preflight_refuses_the_unseen_gpu_before_the_cpus_own_refusals_unless_allow_cpu(monkeypatch, tmp_path):
    fake_nvidia_smi(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", None)
    argv = ["--output_dir", str(tmp_path / "runs"), "--preset", "micro", "--max_seq_length", "64"]
    with pytest.raises(ValueError, match=r"^the NVIDIA driver sees a GPU .* or pass --allow_cpu to train"):
        preflight(*parse_args([*argv, "--mixed_precision", "fp16"]), cuda=False)  # its cause, not "fp16 needs"
    preflight(*parse_args([*argv, "--allow_cpu"]), cuda=False)  # trains on the CPU, as asked
    with pytest.raises(ValueError, match="fp16 needs a CUDA GPU"):
        preflight(*parse_args([*argv, "--allow_cpu", "--mixed_precision", "fp16"]), cuda=False)


def launched_with(monkeypatch, ds_config: dict | str) -> None:
    """The environment `accelerate launch --deepspeed_config_file <ds_config>` gives the loop."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds_config))


def test_torch_compile_under_zero3_is_refused_by_the_loop_before_torch_and_by_the_plan_checker(
    monkeypatch, tmp_path, capsys
):
    train = parse_args(["--torch_compile"])[2]
    zero3 = json.loads((ROOT / "ds_configs/zero3.json").read_text())
    assert zero3_compile_problem(train, zero3)[1] == (
        "launch with a ZeRO-0/1/2 config (ds_configs/zero2.json) or drop --torch_compile"
    )
    assert zero3_compile_problem(train, json.loads((ROOT / "ds_configs/zero2.json").read_text())) is None
    assert zero3_compile_problem(parse_args([])[2], zero3) is None
    launched_with(monkeypatch, ROOT / "ds_configs/zero3.json")
    with pytest.raises(SystemExit) as refused:
        fail_fast(["--torch_compile", "--output_dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert refused.value.code == 1 and err.startswith(
        "error: --torch_compile under ZeRO-3 (this launch's ds config has stage 3): dynamo would trace the hooks "
        "with which ZeRO-3 gathers each layer's partitioned parameters; launch with a ZeRO-0/1/2 config"
    )
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    assert check_plan.main(["--profile", "cpu", "--ds_config", "ds_configs/zero3.json", "--torch_compile"]) == 1
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert "torch.compile" in line and "dynamo would trace the hooks" in line
    assert "fix: launch with a ZeRO-0/1/2 config (ds_configs/zero2.json) or drop --torch_compile" in out


def fake_c_compiler(monkeypatch, tmp_path, fails_on: str | None) -> None:
    """`$CC`: a script that fails when its arguments contain `fails_on` (" -c ": the header, "-laio": the library)."""
    script = tmp_path / "cc"
    script.write_text(
        f'#!/bin/sh\ncase " $* " in *"{fails_on}"*) exit 1;; esac\nexit 0\n' if fails_on else "#!/bin/sh\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))


def cuda_toolkit(monkeypatch, tmp_path, nvcc: bool) -> None:
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    if nvcc:
        (home / "bin" / "nvcc").write_text("#!/bin/sh\n")
        (home / "bin" / "nvcc").chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(home))


NVME = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}}


@pytest.mark.parametrize(
    ("fails_on", "nvcc", "cuda", "missing"),
    [
        (" -c ", True, True, "libaio's header (libaio.h) is not found"),
        ("-laio", True, False, "libaio's library (libaio.so) is not found"),
        (None, False, True, "no CUDA compiler (nvcc in $CUDA_HOME/bin, on PATH or in /usr/local/cuda)"),
        (
            "-laio",
            False,
            True,
            "libaio's library (libaio.so) is not found and no CUDA compiler (nvcc in $CUDA_HOME/bin",
        ),
        (None, False, False, None),  # a CPU machine builds async_io with g++ alone
        (None, True, True, None),
    ],
    ids=["no-header", "no-library", "no-nvcc", "neither", "cpu-needs-no-nvcc", "all-there"],
)
def test_nvme_offload_names_what_its_io_op_cannot_be_built_without(
    monkeypatch, tmp_path, fails_on, nvcc, cuda, missing
):
    fake_c_compiler(monkeypatch, tmp_path, fails_on)
    cuda_toolkit(monkeypatch, tmp_path, nvcc)
    problem = machine_checks.nvme_offload_problem(NVME, cuda=cuda)
    if missing is None:
        assert problem is None
        return
    what, fix = problem
    assert what.startswith(f"NVMe offload needs DeepSpeed's async_io op, which cannot be built here: {missing}")
    assert ("apt install libaio-dev" in fix) == ("libaio" in missing)
    assert ("set CUDA_HOME" in fix) == ("nvcc" in missing)
    assert machine_checks.nvme_offload_problem({"zero_optimization": {"stage": 3}}, cuda=cuda) is None


def test_without_a_c_compiler_libaio_cannot_be_told_and_the_compiler_is_what_is_named(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(machine_checks.shutil, "which", lambda name: None)
    what, fix = machine_checks.nvme_offload_problem(NVME, cuda=False)
    assert what.endswith("cannot be built here: no C compiler (cc, gcc or $CC)") and "build-essential" in fix


def test_a_deepspeed_built_with_the_io_op_needs_no_toolchain(monkeypatch, tmp_path):
    package = tmp_path / "deepspeed"
    package.mkdir()
    (package / "git_version_info_installed.py").write_text(
        "version='0.19.8'\ninstalled_ops={'async_io': True, 'cpu_adam': False}\naccelerator_name='cuda'\n"
    )
    spec = types.SimpleNamespace(origin=str(package / "__init__.py"))
    monkeypatch.setattr(machine_checks.importlib.util, "find_spec", lambda name: spec)
    assert machine_checks.prebuilt_op("async_io", "cuda") and not machine_checks.prebuilt_op("async_io", "cpu")
    assert not machine_checks.prebuilt_op("cpu_adam", "cuda")
    fake_c_compiler(monkeypatch, tmp_path, " -c ")
    assert machine_checks.nvme_offload_problem(NVME, cuda=True) is None


def test_nvme_offload_without_libaio_is_refused_by_the_loop_and_the_plan_checker(monkeypatch, tmp_path, capsys):
    fake_c_compiler(monkeypatch, tmp_path, " -c ")
    ds_config = tmp_path / "nvme.json"
    ds_config.write_text(json.dumps(NVME))
    launched_with(monkeypatch, ds_config)
    with pytest.raises(SystemExit) as refused:
        fail_fast(["--output_dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert refused.value.code == 1 and err.startswith(
        "error: NVMe offload needs DeepSpeed's async_io op, which cannot be built here: libaio's header (libaio.h) "
        "is not found; install libaio's development files (apt install libaio-dev"
    )
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    assert check_plan.main(["--profile", "cpu", "--ds_config", str(ds_config)]) == 1
    [line] = [line for line in capsys.readouterr().out.splitlines() if "NVMe offload op" in line]
    assert line.startswith("ERROR") and "libaio's header (libaio.h) is not found" in line
    fake_c_compiler(monkeypatch, tmp_path, None)  # libaio there: the plan is sound
    assert check_plan.main(["--profile", "cpu", "--ds_config", str(ds_config)]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if "NVMe offload op" in line]
    assert line.startswith("OK") and "buildable here (libaio found)" in line


class FakeBuilder:
    def __init__(self, error: Exception | None):
        self.error = error

    def is_compatible(self, verbose=False):
        return True

    def load(self, verbose=False):
        if self.error is not None:
            raise self.error


def test_build_ops_exits_1_naming_the_op_that_did_not_build_and_the_compilers_error(monkeypatch, tmp_path, capsys):
    error = RuntimeError(
        "Error building extension 'cpu_adam'\n[1/3] c++ -c cpu_adam.cpp\nfatal error: omp.h: No such file"
    )
    builders = {"CPUAdamBuilder": FakeBuilder(error), "ShareMemCommBuilder": FakeBuilder(None)}
    accelerator = types.SimpleNamespace(create_op_builder=builders.get)
    module = types.ModuleType("deepspeed.accelerator")
    module.get_accelerator = lambda: accelerator
    monkeypatch.setitem(sys.modules, "deepspeed.accelerator", module)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # no lock files of anyone's
    assert build_ops.main([]) == 1
    out, err = capsys.readouterr()
    assert "DeepSpeed op deepspeed_shm_comm: ready" in out
    [line] = err.splitlines()
    assert line.startswith(
        "error: DeepSpeed's cpu_adam op did not build (RuntimeError: Error building extension 'cpu_adam': fatal "
        "error: omp.h: No such file); install what it names"
    )
    builders["CPUAdamBuilder"] = FakeBuilder(None)
    assert build_ops.main([]) == 0


@pytest.fixture
def torch_threads():
    """Torch's CPU thread count, restored after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("environment", "threads"),
    [
        ({"OMP_NUM_THREADS": "1"}, 4),  # accelerate's default: 8 cores / 2 local processes
        ({}, 4),
        ({"OMP_NUM_THREADS": "3"}, None),  # someone's choice: torch keeps its own
        ({"OMP_NUM_THREADS": "1", "CPU_THREADS": "5"}, 5),
        ({"OMP_NUM_THREADS": "3", "CPU_THREADS": "1"}, 1),
    ],
    ids=["launcher-one", "unset", "user-omp", "cpu-threads", "cpu-threads-pins-one"],
)
def test_each_process_gets_its_share_of_the_cores_on_a_gpu_machine(monkeypatch, torch_threads, environment, threads):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("CPU_THREADS", "OMP_NUM_THREADS", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert runtime.cpu_threads() == threads
    # what a driver expects a 2-process launch's ranks to use: the count they apply (torch follows a chosen OMP's)
    assert runtime.launch_threads(2) == (threads or int(environment["OMP_NUM_THREADS"]))
    torch.set_num_threads(2 if threads != 2 else 3)
    before = torch.get_num_threads()
    assert runtime.use_cpu_cores() == (threads or before) == torch.get_num_threads()
