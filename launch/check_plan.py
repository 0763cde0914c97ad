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
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from concept_encoder import memory  # noqa: E402
from concept_encoder.cli_types import at_least  # noqa: E402
from concept_encoder.data.arguments import DataArguments  # noqa: E402
from concept_encoder.extension_locks import stale_lock_message, stale_op_locks  # noqa: E402
from concept_encoder.training.args import (  # noqa: E402
    ModelArguments,
    TrainingArguments,
    parse_args,
    read_yaml_mapping,
)
from concept_encoder.training.checkpoint import CheckpointError, resolve_resume  # noqa: E402
from concept_encoder.training.plan import (  # noqa: E402
    decoded_fraction,
    deepspeed_batch_values,
    ds_config_problems,
    fresh_model_fields,
    launch_command,
    output_dir_problem,
)

PROFILES_FILE = ROOT / "launch" / "profiles.yaml"
PROFILE_KEYS = {"accelerate_config", "ds_config", "gpus", "gpu_memory_gb", "gpu_capability", "host_memory_gb",
                "nodes", "processes", "make_target", "loop"}  # fmt: skip
HEADROOM = 0.85  # above this share of the GPU budget: WARNING
OK, WARNING, ERROR = "OK", "WARNING", "ERROR"


class UsageError(Exception):
    """Bad command line or unreadable input: exit code 2."""


@dataclass
class Check:
    name: str
    status: str
    reason: str
    fix: str = ""


@dataclass
class Plan:
    """Where the loop runs (machine and launch settings) and what it runs (the loop's parsed arguments)."""

    model: ModelArguments
    data: DataArguments
    train: TrainingArguments
    mixed_precision: str = "no"  # effective: --mixed_precision, else the accelerate config's, else no
    profile: str | None = None
    accelerate_config: str | None = None
    ds_config: str | None = None
    world_size: int = 1
    gpus_per_node: int = 0  # declared or visible; 0 = a CPU plan
    nodes: int = 1
    gpu_memory_gb: float | None = None
    gpu_capability: float | None = None
    host_memory_gb: float | None = None


def parse_size_gb(text: str) -> float:
    try:
        return memory.parse_size_gb(text)
    except ValueError as error:
        raise UsageError(str(error)) from error


def build_parser() -> argparse.ArgumentParser:
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
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def read_profile(name: str) -> dict:
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


def tokenizer_info(spec: str) -> dict:
    """What can be learned offline about a tokenizer: vocab size, pad/mask presence."""
    match = re.fullmatch(r"train:(wordpiece|bpe):(\d+)", spec)
    if match:
        return {"kind": "trained", "vocab_size": int(match.group(2)), "pad": True, "mask": True}
    if spec.startswith("train:"):
        return {"kind": "invalid"}
    path = Path(spec).expanduser()
    if not path.exists():
        return {"kind": "hub"}
    info: dict = {"kind": "local"}
    tok_json = path / "tokenizer.json"
    if tok_json.exists():
        data = json.loads(tok_json.read_text())
        vocab = (data.get("model") or {}).get("vocab") or {}
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [t["id"] for t in data.get("added_tokens", [])]
        info["vocab_size"] = max(ids) + 1 if ids else None
    specials = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (path / name).exists():
            specials.update(json.loads((path / name).read_text()))
    info["pad"] = bool(specials.get("pad_token"))
    info["mask"] = bool(specials.get("mask_token"))
    return info


def model_config(plan: Plan, vocab_size: int | None) -> dict:
    path = plan.model.model_name_or_path
    if path and (Path(path) / "config.json").exists():
        return json.loads((Path(path) / "config.json").read_text())
    return fresh_model_fields(plan.model, plan.data.max_seq_length, vocab_size=vocab_size or 30522)


def check_batch(plan: Plan, ds_cfg) -> list[Check]:
    checks = []
    if plan.world_size < 1:
        return [Check("batch arithmetic", ERROR, f"world size {plan.world_size}", "--num_processes >= 1")]
    values = deepspeed_batch_values(plan.train, plan.world_size)
    reason = (
        f"global batch {values['train_batch_size']} = micro {values['train_micro_batch_size_per_gpu']} × "
        f"accumulation {values['gradient_accumulation_steps']} × world {plan.world_size}"
    )
    problems = [
        f"ds config {key}={(ds_cfg or {}).get(key)} but the plan gives {expected}"
        for key, expected in values.items()
        if (ds_cfg or {}).get(key, "auto") not in ("auto", expected)
    ]
    if problems:
        checks.append(
            Check("batch arithmetic", ERROR, "; ".join(problems), 'set those keys to "auto" in the ds config')
        )
    else:
        checks.append(Check("batch arithmetic", OK, reason + (" (ds config: auto)" if ds_cfg else "")))
    if not plan.gpus_per_node and plan.gpu_memory_gb is not None:
        checks.append(
            Check(
                "world size vs GPUs",
                ERROR,
                f"{plan.gpus_per_node} GPUs per machine, but the plan budgets {plan.gpu_memory_gb:g} GiB per GPU",
                "--gpus 1 or more, or plan for the CPU (--profile cpu)",
            )
        )
    elif plan.gpus_per_node:
        slots = plan.gpus_per_node * plan.nodes
        if plan.world_size > slots:
            checks.append(
                Check(
                    "world size vs GPUs",
                    ERROR,
                    f"{plan.world_size} processes but only {slots} GPUs ({plan.gpus_per_node}/machine × {plan.nodes})",
                    f"--num_processes {slots}, or more machines",
                )
            )
        elif plan.world_size < slots:
            checks.append(
                Check(
                    "world size vs GPUs",
                    WARNING,
                    f"{plan.world_size} processes for {slots} GPUs: {slots - plan.world_size} would idle",
                    f"--num_processes {slots}",
                )
            )
        else:
            checks.append(Check("world size vs GPUs", OK, f"one process per GPU ({slots})"))
    else:
        checks.append(Check("world size vs GPUs", OK, f"CPU plan with {plan.world_size} process(es) (gloo)"))
    return checks


def check_zero(plan: Plan, ds_cfg, estimate) -> list[Check]:
    if ds_cfg is None:
        return [Check("ZeRO / offload", OK, "no DeepSpeed: plain accelerate (DDP when several processes)")]
    stage, offload_opt, offload_par = memory.zero_settings(ds_cfg)
    zero = ds_cfg.get("zero_optimization", {}) or {}
    checks = []
    if offload_par and stage != 3:
        checks.append(
            Check(
                "ZeRO / offload",
                ERROR,
                f"offload_param needs ZeRO stage 3, the ds config has stage {stage}",
                "use ds_configs/zero3_offload.json, or drop offload_param",
            )
        )
    else:
        what = ", ".join(x for x, on in (("optimizer", offload_opt), ("parameters", offload_par)) if on) or "nothing"
        checks.append(Check("ZeRO / offload", OK, f"stage {stage}, offloads {what}"))
    if offload_opt:
        has_ds = importlib.util.find_spec("deepspeed") is not None
        compiler = shutil.which("g++") or shutil.which("c++")
        if not has_ds or not compiler:
            missing = "DeepSpeed is not installed" if not has_ds else "no C++ compiler (g++) to JIT-build CPU Adam"
            checks.append(
                Check(
                    "CPU Adam op",
                    ERROR,
                    missing,
                    "install g++ (apt-get install g++) and deepspeed, or prebuild: DS_BUILD_CPU_ADAM=1 pip install deepspeed",
                )
            )
        elif stale := stale_op_locks("cpu_adam"):
            checks.append(Check("CPU Adam op", ERROR, stale_lock_message("cpu_adam", stale), f"rm {stale[0]}"))
        else:
            checks.append(Check("CPU Adam op", OK, f"buildable here with {compiler} (JIT on first use, then cached)"))
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) or {}
        if section.get("device") == "nvme":
            path = Path(section.get("nvme_path", ""))
            if "REPLACE" in str(path) or not path.is_dir():
                checks.append(
                    Check(
                        f"NVMe path ({key})",
                        ERROR,
                        f"{path} does not exist",
                        "set nvme_path to a fast local NVMe folder",
                    )
                )
            elif not os.access(path, os.W_OK):
                checks.append(Check(f"NVMe path ({key})", ERROR, f"{path} is not writable", "fix its permissions"))
            else:
                checks.append(Check(f"NVMe path ({key})", OK, f"{path} is writable"))
    if plan.host_memory_gb:
        host, nvme = host_and_nvme_gib(ds_cfg, estimate)
        share = host / plan.host_memory_gb
        status = ERROR if share > 1 else WARNING if share > HEADROOM else OK
        source = f"swap buffers; ~{nvme:.1f} GiB of model states on the NVMe" if nvme else "DeepSpeed's estimator"
        checks.append(
            Check(
                "host RAM for model states",
                status,
                f"~{host:.1f} GiB of {plan.host_memory_gb:.1f} GiB per machine ({source})",
                "" if status == OK else "NVMe offload (ds_configs/zero3_nvme.json), a smaller preset, or more RAM",
            )
        )
    return checks


def host_and_nvme_gib(ds_cfg, estimate) -> tuple[float, float]:
    """(host RAM, NVMe) GiB of the offloaded model states per machine (`memory.host_and_nvme_bytes`)."""
    host, nvme = memory.host_and_nvme_bytes(ds_cfg, estimate.cpu_model_states, estimate.parameters)
    return host / memory.GIB, nvme / memory.GIB


def check_precision(plan: Plan, ds_cfg) -> list[Check]:
    checks = []
    ds_bf16 = ((ds_cfg or {}).get("bf16") or {}).get("enabled", False)
    ds_fp16 = ((ds_cfg or {}).get("fp16") or {}).get("enabled", False)
    if ds_bf16 is True and ds_fp16 is True:
        return [
            Check("precision", ERROR, "the ds config enables both bf16 and fp16", "enable only one (bf16 on Ampere+)")
        ]
    effective = "bf16" if ds_bf16 is True else "fp16" if ds_fp16 is True else plan.mixed_precision
    if ds_bf16 is True and plan.mixed_precision == "fp16" or ds_fp16 is True and plan.mixed_precision == "bf16":
        checks.append(
            Check(
                "precision",
                ERROR,
                f"ds config fixes {effective} but --mixed_precision is {plan.mixed_precision}",
                'set "enabled": "auto" in the ds config',
            )
        )
        return checks
    if effective == "bf16" and plan.gpu_capability is not None and plan.gpu_capability < 8.0:
        checks.append(
            Check(
                "precision",
                ERROR,
                f"bf16 needs compute capability >= 8.0, the GPU has {plan.gpu_capability}",
                "--mixed_precision fp16 (with loss scaling) on this GPU",
            )
        )
    else:
        note = f" on compute capability {plan.gpu_capability}" if plan.gpu_capability else ""
        checks.append(Check("precision", OK, f"{effective}{note}"))
    return checks


def check_shapes(plan: Plan, config: dict, tok: dict) -> list[Check]:
    checks = []
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    if hidden % heads:
        checks.append(
            Check("hidden % heads", ERROR, f"hidden_size={hidden} is not divisible by {heads} heads", "change either")
        )
    else:
        checks.append(Check("hidden % heads", OK, f"{hidden} / {heads} heads = {hidden // heads} per head"))
    max_pos = config["max_position_embeddings"]
    if plan.data.max_seq_length > max_pos:
        checks.append(
            Check(
                "sequence length",
                ERROR,
                f"max_seq_length={plan.data.max_seq_length} > max_position_embeddings={max_pos} of {plan.model.model_name_or_path}",
                f"--max_seq_length {max_pos}",
            )
        )
    else:
        checks.append(Check("sequence length", OK, f"{plan.data.max_seq_length} <= {max_pos} positions"))
    if tok["kind"] == "invalid":
        checks.append(
            Check("tokenizer", ERROR, f"{plan.data.tokenizer!r} is not train:<wordpiece|bpe>:<vocab>", "fix the spec")
        )
    elif tok["kind"] == "hub":
        checks.append(
            Check(
                "tokenizer", WARNING, f"{plan.data.tokenizer} looks like a Hub name: not checked (no network use)", ""
            )
        )
    else:
        if not (tok.get("pad") and tok.get("mask")):
            missing = " and ".join(x for x in ("pad", "mask") if not tok.get(x))
            checks.append(
                Check(
                    "tokenizer",
                    ERROR,
                    f"{plan.data.tokenizer} has no {missing} token",
                    "add it, or train one (train:...)",
                )
            )
        vocab = tok.get("vocab_size")
        if vocab and plan.model.model_name_or_path and vocab > config["vocab_size"]:
            checks.append(
                Check(
                    "vocabulary",
                    ERROR,
                    f"tokenizer has {vocab} tokens, the model's vocab_size is {config['vocab_size']}",
                    "use the model's own tokenizer or resize the embeddings",
                )
            )
        elif tok.get("pad") and tok.get("mask"):
            checks.append(Check("tokenizer", OK, f"{tok['kind']}, ~{vocab or '?'} tokens, pad and mask present"))
    return checks


def check_paths(plan: Plan) -> list[Check]:
    checks = []
    if plan.data.dataset == "embedded":
        checks.append(Check("dataset", OK, "embedded corpus (no network)"))
    elif Path(plan.data.dataset).expanduser().exists():
        path = Path(plan.data.dataset).expanduser()
        empty = path.is_file() and path.stat().st_size == 0 or path.is_dir() and not any(path.iterdir())
        checks.append(
            Check("dataset", ERROR, f"{path} is empty", "point --dataset at text files")
            if empty
            else Check("dataset", OK, f"local {path}")
        )
    elif plan.data.dataset.startswith((".", "/", "~")) or Path(plan.data.dataset).suffix in (
        ".txt",
        ".jsonl",
        ".json",
        ".parquet",
    ):
        checks.append(Check("dataset", ERROR, f"{plan.data.dataset}: no such file or folder", "fix the path"))
    else:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        checks.append(
            Check(
                "dataset",
                WARNING,
                f"Hub dataset {plan.data.dataset}: not checked by the plan check{' (offline mode is on)' if offline else ''}",
                "make sure the training machine can reach the Hub, or pass a local path",
            )
        )
    if plan.model.model_name_or_path and not (Path(plan.model.model_name_or_path) / "config.json").exists():
        checks.append(
            Check(
                "model path", ERROR, f"{plan.model.model_name_or_path} holds no config.json", "a save_pretrained folder"
            )
        )
    out = Path(plan.train.output_dir).expanduser()
    if problem := output_dir_problem(plan.train.output_dir):
        checks.append(Check("output dir", ERROR, problem, "choose --output_dir"))
    else:
        checks.append(Check("output dir", OK, f"{out} writable"))
    if plan.train.resume_from_checkpoint:
        checks.append(check_resume(plan, out))
    return checks


def check_resume(plan: Plan, out: Path) -> Check:
    """The checkpoint the loop would resume, found by the loop's own `resolve_resume` (its errors, word for
    word: not a checkpoint, damaged against its manifest), and not the folder new runs are written to."""
    try:
        found = resolve_resume(plan.train.resume_from_checkpoint, plan.train.output_dir, plan.train.run_name)
    except CheckpointError as error:
        return Check("resume checkpoint", ERROR, str(error), "a <run>/checkpoints/step_N folder, or auto")
    if found is None:
        return Check("resume checkpoint", OK, "auto: no intact checkpoint of this run yet, so a fresh start")
    if out.resolve() == found.resolve() or found.resolve() in out.resolve().parents:
        return Check(
            "resume checkpoint",
            ERROR,
            f"--output_dir {out} is (inside) the checkpoint being resumed: new runs would write into it",
            "keep --output_dir at the runs folder (e.g. Cache/runs); a resumed run continues in its own run dir",
        )
    return Check("resume checkpoint", OK, f"{found} (the run continues in {found.parent.parent})")


def plan_estimate(plan: Plan, config: dict, ds_cfg):
    stage, offload_opt, offload_par = memory.zero_settings(ds_cfg)
    return memory.estimate_training_memory(
        config,
        plan.train.per_device_train_batch_size,
        plan.data.max_seq_length,
        zero_stage=stage,
        offload_optimizer=offload_opt,
        offload_params=offload_par,
        gpus_per_node=max(plan.gpus_per_node, 1) if plan.gpus_per_node else max(plan.world_size, 1),
        nodes=plan.nodes,
        mixed_precision=plan.mixed_precision,
        gradient_checkpointing=plan.model.gradient_checkpointing,
        mlm_probability=decoded_fraction(plan.train, plan.data.mlm_probability),
    )


def check_memory(plan: Plan, estimate) -> list[Check]:
    peak = estimate.gpu_peak / memory.GIB
    parts = estimate.as_gib()
    detail = (
        f"model states {parts['gpu_model_states_gib']:.2f} + activations {parts['activations_gib']:.2f} "
        f"+ workspace {parts['workspace_gib']:.2f}"
    )
    if plan.gpu_memory_gb is None:
        return [Check("GPU memory", OK, f"no GPU planned; a GPU would need ~{peak:.2f} GiB ({detail})")]
    share = peak / plan.gpu_memory_gb
    fix = "--suggest for configs that fit; or lower the micro-batch, use --gradient_checkpointing, or offload"
    if share > 1:
        return [Check("GPU memory", ERROR, f"~{peak:.2f} GiB > {plan.gpu_memory_gb:g} GiB budget ({detail})", fix)]
    if share > HEADROOM:
        return [
            Check(
                "GPU memory", WARNING, f"~{peak:.2f} GiB is {share:.0%} of {plan.gpu_memory_gb:g} GiB ({detail})", fix
            )
        ]
    return [Check("GPU memory", OK, f"~{peak:.2f} GiB of {plan.gpu_memory_gb:g} GiB ({share:.0%}; {detail})")]


def suggest(plan: Plan, config: dict) -> list[dict]:
    """Every ds config (and plain DDP) with its estimated GPU peak, host RAM and NVMe use: those that fit
    both the GPU and the host RAM first, and among them no offload before optimizer offload before
    parameter offload before NVMe (each costs step time), then by estimated peak memory."""
    rows = []
    candidates = [("none", None)] + [
        (p.stem, json.loads(p.read_text())) for p in sorted((ROOT / "ds_configs").glob("*.json"))
    ]
    for name, cfg in candidates:
        stage, offload_opt, offload_par = memory.zero_settings(cfg)
        nvme = memory.nvme_offloaded(cfg)
        est = plan_estimate(plan, config, cfg)
        peak = est.gpu_peak / memory.GIB
        host, on_nvme = host_and_nvme_gib(cfg, est)
        gpu_fits = plan.gpu_memory_gb is None or peak <= HEADROOM * plan.gpu_memory_gb
        host_fits = not plan.host_memory_gb or host <= HEADROOM * plan.host_memory_gb
        where = "nvme" if nvme else "params+optimizer" if offload_par else "optimizer" if offload_opt else "none"
        rows.append(
            {
                "ds_config": name,
                "zero_stage": stage,
                "offload": where,
                "_cost": 3 if nvme else 2 if offload_par else 1 if offload_opt else 0,
                "est_gpu_peak_gib": round(peak, 2),
                "est_host_gib": round(host, 2),
                "est_nvme_gib": round(on_nvme, 2),
                "fits": gpu_fits and host_fits,
                "why_not": "" if gpu_fits and host_fits else "GPU" if not gpu_fits else "host RAM",
            }
        )
    rows.sort(key=lambda r: (not r["fits"], r["_cost"], r["est_gpu_peak_gib"]))
    for row in rows:
        del row["_cost"]
    return rows


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


def run_checks(plan: Plan, ds_cfg) -> tuple[list[Check], dict, object]:
    tok = tokenizer_info(plan.data.tokenizer)
    config = model_config(plan, tok.get("vocab_size"))
    estimate = plan_estimate(plan, config, ds_cfg)
    checks = check_batch(plan, ds_cfg)
    checks += check_zero(plan, ds_cfg, estimate)
    checks += check_precision(plan, ds_cfg)
    checks += check_shapes(plan, config, tok)
    checks += check_paths(plan)
    checks += check_memory(plan, estimate)
    checks += check_gates(plan)
    return checks, config, estimate


def check_gates(plan: Plan) -> list[Check]:
    """The decision gates (their syntax and metric names were checked by the loop's parser)."""
    if not plan.train.gate:
        return []
    late = [g for g in plan.train.gates if g.first_step > plan.train.max_steps]
    listed = ", ".join(g.text for g in plan.train.gates)
    if late:
        return [Check("decision gates", WARNING, f"{', '.join(g.text for g in late)} start after --max_steps "
                      f"{plan.train.max_steps}: never checked", "lower the gate's @step or raise --max_steps")]  # fmt: skip
    every = plan.train.eval_steps or plan.train.max_steps
    return [Check("decision gates", OK, f"{listed}; checked every {every} steps, on failure: {plan.train.gate_action}")]


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<8} {c.name:<{width}}  {c.reason}")
        if c.fix and c.status != OK:
            lines.append(f"{'':<8} {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def describe_gpus(count: int, memory_gb: float | None) -> str:
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
        print(f"\n{verdict}\n\n  {shlex.join(command)}")
    if errors:
        return 1
    if args.run:
        executable = shutil.which("accelerate") or str(Path(sys.executable).with_name("accelerate"))
        os.chdir(ROOT)  # the accelerate configs name ds configs relative to the project root
        os.execv(executable, [executable, *command[1:]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
