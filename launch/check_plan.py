"""Launch plan checker: catch a bad (multi-)GPU plan in about a second, before it burns hours.

    python launch/check_plan.py --profile rtx3080_10gb --dataset wikitext:wikitext-103-raw-v1
    python launch/check_plan.py --accelerate_config launch/multi_gpu.yaml --preset large \\
        --per_device_train_batch_size 16 --gpus 4 --gpu_memory 24GB
    python launch/check_plan.py --profile rtx3080_10gb --suggest          # ds configs that fit, cheapest first
    python launch/check_plan.py --profile cpu --run --max_steps 50        # check, then launch if sound

Where it runs comes from a hardware profile of `launch/profiles.yaml`, or an accelerate config
and a ds config, plus `--gpus/--gpu_memory/--nodes` for a machine you are not on. What runs is
every flag of `loops/mlm.py` (and `--config run.yaml`), parsed by the loop's own parser
(`concept_encoder.training.args.parse_args`): the same names, defaults and validation, so a value
the loop would reject is a usage error here too, and an unknown flag is an error, not passed on.
A profile's `loop:` section gives the loop's defaults; `--config` and the flags override it.

Every check is OK / WARNING / ERROR with a reason and a fix; exit 0 without ERROR, 1 with one,
2 on usage errors. It ends with the exact launch command. It imports no torch: the memory model,
presets, argument dataclasses and derived rules (`concept_encoder.training.plan`) are torch-free.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from concept_encoder.accounting import memory  # noqa: E402
from concept_encoder.common import process_group  # noqa: E402
from concept_encoder.common.cli_types import at_least  # noqa: E402
from concept_encoder.common.dataclass_args import read_yaml_mapping  # noqa: E402
from concept_encoder.machine.checks import host_memory_bytes  # noqa: E402
from concept_encoder.training.args import parse_args  # noqa: E402
from concept_encoder.training.plan import ds_config_problems, launch_command  # noqa: E402
from launch.plan_checks import ERROR, HEADROOM, OK, Check, Plan, run_checks, suggest  # noqa: E402

PROFILES_FILE = ROOT / "launch" / "profiles.yaml"
PROFILE_KEYS = {"accelerate_config", "ds_config", "gpus", "gpu_memory_gb", "gpu_capability", "host_memory_gb",
                "nodes", "processes", "make_target", "loop"}  # fmt: skip


class UsageError(Exception):
    """Bad command line or unreadable input: exit code 2."""


def parse_size_gb(text: str) -> float:
    """`10GB` / `512MB` as GiB; a bad size is a usage error."""
    try:
        return memory.parse_size_gb(text)
    except ValueError as error:
        raise UsageError(str(error)) from error


def build_parser() -> argparse.ArgumentParser:
    """The checker's own flags (where it runs, output); every other flag is the loop's."""
    p = argparse.ArgumentParser(
        prog="launch/check_plan.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # a prefix of a loop flag must not be taken for one of ours
        epilog="The loop's flags: see `python loops/mlm.py --help`; every one is accepted here.",
    )
    where = p.add_argument_group("where it runs")
    where.add_argument("--profile", help=f"a profile of {PROFILES_FILE.relative_to(ROOT)}")
    where.add_argument("--accelerate_config", help="accelerate config YAML (launch/*.yaml)")
    where.add_argument("--ds_config", help="DeepSpeed JSON (default: the one the accelerate config names)")
    where.add_argument("--num_processes", type=at_least(1), help="world size (default: the accelerate config's)")
    where.add_argument(
        "--gpus", type=at_least(0), help="GPUs per machine of the planned machine (default: visible ones)"
    )
    where.add_argument("--gpu_memory", help="memory of each planned GPU, e.g. 10GB (default: the visible GPU's)")
    where.add_argument("--gpu_capability", type=float, help="CUDA compute capability of the planned GPU, e.g. 8.6")
    where.add_argument("--nodes", type=at_least(1), help="machines (default: the accelerate config's num_machines)")
    where.add_argument("--host_memory", help="host RAM per machine, e.g. 64GB (default: this machine's)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="machine-readable output")
    out.add_argument("--suggest", action="store_true", help="list the ds configs that fit the budget, cheapest first")
    out.add_argument("--run", action="store_true", help="launch the plan when it has no ERROR")
    return p


def read_yaml(path: Path, what: str) -> dict:
    """A YAML mapping (`read_yaml_mapping`); an unreadable one is a usage error."""
    try:
        return read_yaml_mapping(path, what)
    except ValueError as error:
        raise UsageError(str(error)) from error


def visible_gpus() -> list[dict]:
    """GPUs `nvidia-smi` reports (name, memory GiB, compute capability); none when it is absent."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "memory_gb": float(parts[1]) / 1024, "capability": float(parts[2])})
    return gpus


def host_memory_gb() -> float | None:
    """This machine's RAM in GiB (/proc/meminfo's MemTotal: the plan is for the machine); None where unreadable."""
    total = host_memory_bytes("MemTotal")
    return None if total is None else total / memory.GIB


def read_profile(name: str) -> dict:
    """A profile of `profiles.yaml`; an unknown name or key is a usage error."""
    profiles = read_yaml(PROFILES_FILE, "profiles file")
    if name not in profiles:
        raise UsageError(f"unknown profile {name!r}; choose one of {sorted(profiles)}")
    profile = profiles[name] or {}
    unknown = sorted(set(profile) - PROFILE_KEYS)
    if unknown:
        raise UsageError(f"profile {name!r} has unknown keys {unknown}; valid keys are {sorted(PROFILE_KEYS)}")
    return profile


def resolve_plan(args, loop_argv: list[str]) -> tuple[Plan, dict, dict | None]:
    """Profile → accelerate config → ds config → the loop's arguments (profile `loop:` defaults, then
    `--config`, then flags, parsed and validated by the loop's parser) → machine flags."""
    profile = read_profile(args.profile) if args.profile else {}
    try:
        model_args, data_args, train_args = parse_args(loop_argv, defaults=profile.get("loop"))
    except ValueError as error:
        raise UsageError(str(error)) from error
    plan = Plan(model_args, data_args, train_args, profile=args.profile)
    if profile:
        plan.gpus_per_node = profile.get("gpus", 0) or 0
        plan.nodes = profile.get("nodes", 1)
        plan.world_size = profile.get("processes", 1)
        plan.accelerate_config = profile.get("accelerate_config")
        plan.ds_config = profile.get("ds_config")
        plan.gpu_memory_gb = profile.get("gpu_memory_gb")
        plan.gpu_capability = profile.get("gpu_capability")
        plan.host_memory_gb = profile.get("host_memory_gb")
    if args.accelerate_config:
        plan.accelerate_config = args.accelerate_config
        plan.ds_config = None
    accelerate_cfg: dict = {}
    if plan.accelerate_config:
        accelerate_cfg = read_yaml(ROOT / plan.accelerate_config, "accelerate config")
        if not args.profile:
            plan.world_size = accelerate_cfg.get("num_processes", 1)
            plan.nodes = accelerate_cfg.get("num_machines", 1)
        if plan.ds_config is None:
            plan.ds_config = (accelerate_cfg.get("deepspeed_config") or {}).get("deepspeed_config_file")
    plan.mixed_precision = train_args.mixed_precision or accelerate_cfg.get("mixed_precision") or "no"
    if args.ds_config:
        plan.ds_config = args.ds_config
    ds_cfg = None
    if plan.ds_config:
        path = Path(plan.ds_config) if Path(plan.ds_config).is_absolute() else ROOT / plan.ds_config
        if not path.is_file():
            raise UsageError(f"ds config {plan.ds_config}: no such file")
        try:
            ds_cfg = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise UsageError(f"ds config {plan.ds_config}: not valid JSON ({error})") from error
        if problems := ds_config_problems(ds_cfg):
            raise UsageError(f"ds config {plan.ds_config}: {'; '.join(problems)}")
    if args.num_processes is not None:
        plan.world_size = args.num_processes
    if args.nodes is not None:
        plan.nodes = args.nodes
    gpus = visible_gpus()
    if args.gpus is not None:
        plan.gpus_per_node = args.gpus
    elif gpus and not args.profile:
        plan.gpus_per_node = len(gpus)
    if args.gpu_memory:
        plan.gpu_memory_gb = parse_size_gb(args.gpu_memory)
    elif gpus and plan.gpu_memory_gb is None:
        plan.gpu_memory_gb = round(min(g["memory_gb"] for g in gpus), 1)
    if args.gpu_capability:
        plan.gpu_capability = args.gpu_capability
    elif gpus and plan.gpu_capability is None:
        plan.gpu_capability = min(g["capability"] for g in gpus)
    if args.host_memory:
        plan.host_memory_gb = parse_size_gb(args.host_memory)
    elif plan.host_memory_gb is None:
        plan.host_memory_gb = host_memory_gb()  # planning for this machine
    return plan, accelerate_cfg, ds_cfg


def plan_launch_command(plan: Plan, args) -> list[str]:
    """`accelerate launch` with the plan's launch settings, then the loop with its resolved arguments."""
    options = []
    if plan.accelerate_config:
        options += ["--config_file", plan.accelerate_config]
    if args.ds_config:
        options += ["--deepspeed_config_file", plan.ds_config]
    if args.num_processes or (plan.profile and plan.world_size != 1 and not plan.accelerate_config):
        options += ["--num_processes", str(plan.world_size)]
    if args.nodes is not None:
        options += ["--num_machines", str(plan.nodes)]
    return launch_command(options, plan.model, plan.data, plan.train)


def memory_verdict(plan: Plan, estimate) -> str:
    """`~7.0 GiB of 10 GiB GPU, ~25.6 GiB of 31.3 GiB host RAM`: the GPU and the host memory the plan needs."""

    def of(needed: int, have: float | None) -> str:
        return f"~{needed / memory.GIB:.1f} GiB" + (f" of {have:.3g} GiB" if have else "")

    host = f"{of(estimate.host_peak, plan.host_memory_gb)} host RAM"
    return f"{of(estimate.gpu_peak, plan.gpu_memory_gb)} GPU, {host}" if plan.gpus_per_node else f"{host}, CPU plan"


def format_table(checks: list[Check]) -> str:
    """One line per check (status, name, reason), then its fix unless it is OK."""
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<8} {c.name:<{width}}  {c.reason}")
        if c.fix and c.status != OK:
            lines.append(f"{'':<8} {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def describe_gpus(count: int, memory_gb: float | None) -> str:
    """`2 GPUs with 24 GB`."""
    memory = f" with {memory_gb:g} GB" if memory_gb else ""
    return f"{count} GPU{'s' if count != 1 else ''}{memory}"


def machine_mismatch(plan: Plan, gpus: list[dict]) -> str | None:
    """Why this machine cannot run `plan` (launching is for the machine it is on), with the make
    target of a profile that fits it; None when it can."""
    memory = min((g["memory_gb"] for g in gpus), default=0.0)
    short = plan.gpus_per_node > len(gpus) or (plan.gpu_memory_gb or 0) > memory * 1.05
    if not short:
        return None
    have = "none" if not gpus else describe_gpus(len(gpus), round(memory, 1))
    fits = [
        (profile.get("gpu_memory_gb") or 0, profile["make_target"])
        for profile in read_yaml(PROFILES_FILE, "profiles file").values()
        if profile.get("make_target")
        and (profile.get("gpus") or 0) <= len(gpus)
        and (profile.get("gpu_memory_gb") or 0) <= memory * 1.05
    ]
    hint = f"; on this machine: make {max(fits)[1]}" if fits else ""
    return (
        f"profile {plan.profile or 'plan'} needs {describe_gpus(plan.gpus_per_node, plan.gpu_memory_gb)} per "
        f"machine; this machine has {have}{hint} (without --run the plan is checked for the machine it names)"
    )


def main(argv: list[str] | None = None) -> int:
    """Resolve the plan, run the checks, print them and the launch command; with --run, launch a sound plan."""
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--"]  # `--` before loop flags is optional
    args, loop_argv = build_parser().parse_known_args(argv)
    try:
        plan, _, ds_cfg = resolve_plan(args, loop_argv)
    except UsageError as error:
        print(f"usage error: {error}", file=sys.stderr)
        return 2
    if args.run and (mismatch := machine_mismatch(plan, visible_gpus())):
        print(f"error: {mismatch}", file=sys.stderr)
        return 1
    checks, config, estimate = run_checks(plan, ds_cfg)
    command = plan_launch_command(plan, args)
    errors = sum(c.status == ERROR for c in checks)
    suggestions = suggest(plan, config) if args.suggest else None
    if args.json:
        print(
            json.dumps(
                {
                    "plan": asdict(plan),
                    "estimate": estimate.as_gib(),
                    "checks": [asdict(c) for c in checks],
                    "errors": errors,
                    "command": shlex.join(command),
                    **({"suggest": suggestions} if suggestions is not None else {}),
                },
                indent=2,
            )
        )
    else:
        where = plan.profile or plan.accelerate_config or "this machine"
        print(
            f"Launch plan: {where} · {plan.world_size} process(es) · preset {plan.model.preset} · ds {plan.ds_config}\n"
        )
        print(format_table(checks))
        if suggestions is not None:
            host = f"{plan.host_memory_gb:g} GiB host RAM" if plan.host_memory_gb else "this machine's host RAM"
            print(
                f"\nds configs for a {plan.gpu_memory_gb or '?'} GiB GPU and {host} (fits = under {HEADROOM:.0%} "
                "of both), cheapest first:"
            )
            for r in suggestions:
                mark = "fits " if r["fits"] else f"over ({r['why_not']})"
                nvme = f", ~{r['est_nvme_gib']:.2f} GiB NVMe" if r["est_nvme_gib"] else ""
                print(f"  {mark:<16} {r['ds_config']:<14} stage {r['zero_stage']}  offload={r['offload']:<16}  "
                      f"~{r['est_gpu_peak_gib']:.2f} GiB GPU, ~{r['est_host_gib']:.2f} GiB host{nvme}")  # fmt: skip
        verdict = f"{errors} error(s): fix them before launching" if errors else "plan is sound"
        verdict += f" ({memory_verdict(plan, estimate)})"
        print(f"\n{verdict}\n\n  {shlex.join(command)}")
    if errors:
        return 1
    if args.run:
        executable = shutil.which("accelerate") or str(Path(sys.executable).with_name("accelerate"))
        os.chdir(ROOT)  # the accelerate configs name ds configs relative to the project root
        quiet = [executable, command[1], "--quiet", *command[2:]]  # a failed loop's one line, no launcher trace
        return process_group.call_interrupting_ranks(quiet)  # Ctrl-C: the ranks stop at a checkpoint
    return 0


if __name__ == "__main__":
    from concept_encoder.common.entry import run_tool

    sys.exit(run_tool(main, "launch/check_plan.py"))
