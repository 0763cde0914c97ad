"""The launch plan checker's checks: each family reads a resolved `Plan` and returns OK / WARNING / ERROR `Check`s.

The families, in the order `run_checks` reports them: batch arithmetic and world size vs GPUs
(`check_batch`), ZeRO / offload, torch.compile under ZeRO-3, CPU Adam, NVMe paths and build (`check_zero`), host
RAM (`check_host_ram`), precision (`check_precision`), shapes and tokenizer (`check_shapes`), dataset, model,
output and resume paths (`check_paths`, `check_resume`), GPU memory (`check_memory`) and decision gates
(`check_gates`);
`suggest` ranks every ds config for the same plan. `launch/check_plan.py` resolves the plan from the
command line and prints what these return.

Torch-free, like the checker: the memory model, the loop's argument dataclasses and derived rules
(`concept_encoder.training.plan`) import without torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from concept_encoder.accounting import memory
from concept_encoder.checkpoints.checkpoint import CheckpointError, resolve_resume
from concept_encoder.constants import EMBEDDED_DATASET
from concept_encoder.data.arguments import DataArguments
from concept_encoder.data.base import DataSourceError
from concept_encoder.data.docstrings import is_docstrings_spec, site_roots
from concept_encoder.data.licenses import is_licenses_spec
from concept_encoder.data.mixture import is_mixture, parse_mixture
from concept_encoder.data.modules import is_modules_spec
from concept_encoder.machine.checks import nvme_offload_problem
from concept_encoder.machine.extension_locks import stale_lock_message, stale_op_locks
from concept_encoder.training.args import ModelArguments, TrainingArguments
from concept_encoder.training.plan import (
    decoded_fraction,
    deepspeed_batch_values,
    fresh_model_fields,
    output_dir_problem,
    zero3_compile_problem,
)

ROOT = Path(__file__).resolve().parents[1]
HEADROOM = 0.85  # above this share of the GPU budget: WARNING
OK, WARNING, ERROR = "OK", "WARNING", "ERROR"


@dataclass
class Check:
    """One line of the report: a check's name, OK / WARNING / ERROR, why, and how to fix it."""

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


# What the checks read besides the plan: the tokenizer, the model's shape and the memory estimate.


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
    """The model's config fields: a saved model's config.json, else the fields the loop would build."""
    path = plan.model.model_name_or_path
    if path and (Path(path) / "config.json").exists():
        return json.loads((Path(path) / "config.json").read_text())
    return fresh_model_fields(plan.model, plan.data.max_seq_length, vocab_size=vocab_size or 30522)


def plan_estimate(plan: Plan, config: dict, ds_cfg):
    """The memory model's training estimate for this plan under `ds_cfg` (None: no DeepSpeed), with the ZeRO
    buffers it sets; a CPU plan (no GPUs) as the loop runs it, its device side in host RAM and attention by the
    math kernel."""
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
        fused_attention=bool(plan.gpus_per_node),
        ds_config=ds_cfg,
        cpu_run=not plan.gpus_per_node,
    )


def host_and_nvme_gib(ds_cfg, estimate) -> tuple[float, float]:
    """(host RAM, NVMe) GiB per machine: the estimate's host peak (`MemoryEstimate.host_peak`: process baselines,
    fp32 models, offloaded states or NVMe swap buffers) and the model states on the NVMe
    (`memory.host_and_nvme_bytes`)."""
    nvme = memory.host_and_nvme_bytes(ds_cfg, estimate.cpu_model_states, estimate.parameters)[1]
    return estimate.host_peak / memory.GIB, nvme / memory.GIB


# Batch arithmetic and world size.


def check_batch(plan: Plan, ds_cfg) -> list[Check]:
    """Batch arithmetic against the ds config's explicit values, then world size vs GPUs."""
    if plan.world_size < 1:
        return [Check("batch arithmetic", ERROR, f"world size {plan.world_size}", "--num_processes >= 1")]
    return [check_batch_arithmetic(plan, ds_cfg), check_world_size(plan)]


def check_batch_arithmetic(plan: Plan, ds_cfg) -> Check:
    """Global batch = micro × accumulation × world; a ds config value other than "auto" must agree."""
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
        return Check("batch arithmetic", ERROR, "; ".join(problems), 'set those keys to "auto" in the ds config')
    return Check("batch arithmetic", OK, reason + (" (ds config: auto)" if ds_cfg else ""))


def check_world_size(plan: Plan) -> Check:
    """One process per GPU: more processes than GPUs is an error, fewer leaves GPUs idle."""
    if not plan.gpus_per_node and plan.gpu_memory_gb is not None:
        return Check(
            "world size vs GPUs",
            ERROR,
            f"{plan.gpus_per_node} GPUs per machine, but the plan budgets {plan.gpu_memory_gb:g} GiB per GPU",
            "--gpus 1 or more, or plan for the CPU (--profile cpu)",
        )
    if not plan.gpus_per_node:
        return Check("world size vs GPUs", OK, f"CPU plan with {plan.world_size} process(es) (gloo)")
    slots = plan.gpus_per_node * plan.nodes
    if plan.world_size > slots:
        return Check(
            "world size vs GPUs",
            ERROR,
            f"{plan.world_size} processes but only {slots} GPUs ({plan.gpus_per_node}/machine × {plan.nodes})",
            f"--num_processes {slots}, or more machines",
        )
    if plan.world_size < slots:
        return Check(
            "world size vs GPUs",
            WARNING,
            f"{plan.world_size} processes for {slots} GPUs: {slots - plan.world_size} would idle",
            f"--num_processes {slots}",
        )
    return Check("world size vs GPUs", OK, f"one process per GPU ({slots})")


# ZeRO and offload.


def check_zero(plan: Plan, ds_cfg) -> list[Check]:
    """ZeRO stage and offload, --torch_compile under ZeRO-3, the CPU Adam op, NVMe paths and what NVMe offload
    builds with."""
    if ds_cfg is None:
        return [Check("ZeRO / offload", OK, "no DeepSpeed: plain accelerate (DDP when several processes)")]
    stage, offload_opt, offload_par = memory.zero_settings(ds_cfg)
    checks = [check_offload(stage, offload_opt, offload_par)]
    if problem := zero3_compile_problem(plan.train, ds_cfg):
        checks.append(Check("torch.compile", ERROR, *problem))
    if offload_opt:
        checks.append(check_cpu_adam())
    checks += check_nvme_paths(ds_cfg)
    checks += check_nvme_build(plan, ds_cfg)
    return checks


def check_offload(stage: int, offload_opt: bool, offload_par: bool) -> Check:
    """Parameter offload only under ZeRO stage 3."""
    if offload_par and stage != 3:
        return Check(
            "ZeRO / offload",
            ERROR,
            f"offload_param needs ZeRO stage 3, the ds config has stage {stage}",
            "use ds_configs/zero3_offload.json, or drop offload_param",
        )
    what = ", ".join(x for x, on in (("optimizer", offload_opt), ("parameters", offload_par)) if on) or "nothing"
    return Check("ZeRO / offload", OK, f"stage {stage}, offloads {what}")


def check_cpu_adam() -> Check:
    """Optimizer offload needs DeepSpeed's CPU Adam: DeepSpeed and a C++ compiler, and no stale build lock."""
    has_ds = importlib.util.find_spec("deepspeed") is not None
    compiler = shutil.which("g++") or shutil.which("c++")
    if not has_ds or not compiler:
        missing = "DeepSpeed is not installed" if not has_ds else "no C++ compiler (g++) to JIT-build CPU Adam"
        return Check(
            "CPU Adam op",
            ERROR,
            missing,
            "install g++ (apt-get install g++) and deepspeed, or prebuild: DS_BUILD_CPU_ADAM=1 pip install deepspeed",
        )
    if stale := stale_op_locks("cpu_adam"):
        return Check("CPU Adam op", ERROR, stale_lock_message("cpu_adam", stale), f"rm {stale[0]}")
    return Check("CPU Adam op", OK, f"buildable here with {compiler} (JIT on first use, then cached)")


def check_nvme_paths(ds_cfg: dict) -> list[Check]:
    """Every NVMe offload target is an existing, writable folder."""
    zero = ds_cfg.get("zero_optimization", {}) or {}
    checks = []
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
    return checks


def check_nvme_build(plan: Plan, ds_cfg: dict) -> list[Check]:
    """NVMe offload's async_io op can be built on this machine: libaio, and nvcc for a GPU plan
    (`machine.checks.nvme_offload_problem`, which the loop's preflight refuses on too)."""
    if not memory.nvme_offloaded(ds_cfg):
        return []
    if problem := nvme_offload_problem(ds_cfg, cuda=plan.gpus_per_node > 0):
        return [Check("NVMe offload op (async_io)", ERROR, *problem)]
    needs = "libaio and nvcc found" if plan.gpus_per_node else "libaio found"
    return [Check("NVMe offload op (async_io)", OK, f"buildable here ({needs}) or prebuilt in DeepSpeed")]


def check_host_ram(plan: Plan, ds_cfg, estimate) -> list[Check]:
    """The host RAM per machine (`memory.describe_host`: process baselines, fp32 models built before `prepare`,
    offloaded states or NVMe swap buffers, and a CPU plan's device side) against the machine's."""
    if not plan.host_memory_gb:
        return []
    host, nvme = host_and_nvme_gib(ds_cfg, estimate)
    share = host / plan.host_memory_gb
    status = ERROR if share > 1 else WARNING if share > HEADROOM else OK
    on_nvme = f"; ~{nvme:.1f} GiB of model states on the NVMe" if nvme else ""
    reason = f"{memory.describe_host(estimate)} of {plan.host_memory_gb:.1f} GiB per machine{on_nvme}"
    fix = "" if status == OK else "NVMe offload (ds_configs/zero3_nvme.json), a smaller preset, or more RAM"
    return [Check("host RAM", status, reason, fix)]


# Precision.


def check_precision(plan: Plan, ds_cfg) -> list[Check]:
    """One of fp16 / bf16, the ds config agreeing with --mixed_precision, bf16 only on capability >= 8.0."""
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


# Shapes and tokenizer.


def check_shapes(plan: Plan, config: dict, tok: dict) -> list[Check]:
    """Hidden size divisible by the heads, the sequence within the position table, then the tokenizer."""
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
    return checks + check_tokenizer(plan, config, tok)


def check_tokenizer(plan: Plan, config: dict, tok: dict) -> list[Check]:
    """A valid spec, pad and mask tokens, and no more tokens than a saved model's vocabulary."""
    if tok["kind"] == "invalid":
        return [
            Check("tokenizer", ERROR, f"{plan.data.tokenizer!r} is not train:<wordpiece|bpe>:<vocab>", "fix the spec")
        ]
    if tok["kind"] == "hub":
        return [
            Check(
                "tokenizer", WARNING, f"{plan.data.tokenizer} looks like a Hub name: not checked (no network use)", ""
            )
        ]
    checks = []
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


# Paths: dataset, model, output dir, resume checkpoint.


def check_paths(plan: Plan) -> list[Check]:
    """The dataset, a saved model's config.json, a writable output dir and the checkpoint to resume."""
    checks = [check_dataset(plan)]
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


def check_dataset(plan: Plan) -> Check:
    """A built-in offline corpus, a non-empty local file or folder, a Hub name (not checked: no network use), or a
    mixture of them and tasks' training texts (each part checked; the worst verdict stands)."""
    if not is_mixture(plan.data.dataset):
        return check_source(plan.data.dataset)
    parts = parse_mixture(plan.data.dataset)  # the loop's parser accepted it: well formed, its tasks known
    found = [
        Check("dataset", OK, f"{part.spec}: the task's training texts (no network)") if part.task is not None
        else check_source(part.spec)
        for part in parts
    ]  # fmt: skip
    worst = next((c for level in (ERROR, WARNING) for c in found if c.status == level), None)
    weights = ", ".join(f"{p.spec} x{p.weight:g}" for p in parts)
    if worst is not None:
        return Check("dataset", worst.status, f"mixture ({weights}): {worst.reason}", worst.fix)
    return Check("dataset", OK, f"mixture ({weights}): every part offline or local (no network)")


def check_source(spec: str) -> Check:
    """One source of `--dataset`: see check_dataset."""
    if spec == EMBEDDED_DATASET:
        return Check("dataset", OK, "embedded corpus (no network)")
    if is_docstrings_spec(spec) or is_licenses_spec(spec) or is_modules_spec(spec):
        try:
            roots = site_roots(spec)  # the folder after `<corpus>:` must exist
        except DataSourceError as error:
            return Check("dataset", ERROR, str(error), "give an existing site-packages folder")
        return Check("dataset", OK, f"built-in corpus {spec}: read from {', '.join(map(str, roots))} (no network)")
    if Path(spec).expanduser().exists():
        path = Path(spec).expanduser()
        empty = path.is_file() and path.stat().st_size == 0 or path.is_dir() and not any(path.iterdir())
        if empty:
            return Check("dataset", ERROR, f"{path} is empty", "point --dataset at text files")
        return Check("dataset", OK, f"local {path}")
    if spec.startswith((".", "/", "~")) or Path(spec).suffix in (
        ".txt",
        ".jsonl",
        ".json",
        ".parquet",
    ):
        return Check("dataset", ERROR, f"{spec}: no such file or folder", "fix the path")
    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
    return Check(
        "dataset",
        WARNING,
        f"Hub dataset {spec}: not checked by the plan check{' (offline mode is on)' if offline else ''}",
        "make sure the training machine can reach the Hub, or pass a local path",
    )


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


# GPU memory and decision gates.


def check_memory(plan: Plan, estimate) -> list[Check]:
    """The estimated GPU peak against the budget: ERROR above it, WARNING above `HEADROOM` of it. The verdict
    names the host RAM the plan needs beside it (`check_host_ram` judges it)."""
    peak = estimate.gpu_peak / memory.GIB
    parts = estimate.as_gib()
    detail = (
        f"model states {parts['gpu_model_states_gib']:.2f} + activations {parts['activations_gib']:.2f} "
        f"+ ZeRO buffers {parts['zero_buffers_gib']:.2f} + workspace {parts['workspace_gib']:.2f}, of which "
        f"{parts['cuda_context_gib']:.2f} CUDA context; host ~{parts['host_peak_gib']:.1f} GiB"
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


# All of them, and the ds configs that fit.


def run_checks(plan: Plan, ds_cfg) -> tuple[list[Check], dict, object]:
    """Every family in report order; also the model config and the memory estimate they were checked on."""
    tok = tokenizer_info(plan.data.tokenizer)
    config = model_config(plan, tok.get("vocab_size"))
    estimate = plan_estimate(plan, config, ds_cfg)
    checks = check_batch(plan, ds_cfg)
    checks += check_zero(plan, ds_cfg)
    checks += check_host_ram(plan, ds_cfg, estimate)
    checks += check_precision(plan, ds_cfg)
    checks += check_shapes(plan, config, tok)
    checks += check_paths(plan)
    checks += check_memory(plan, estimate)
    checks += check_gates(plan)
    return checks, config, estimate


def suggest(plan: Plan, config: dict) -> list[dict]:
    """Every ds config (and plain DDP) with its estimated GPU peak, host RAM (`host_and_nvme_gib`) and NVMe use:
    those that fit both the GPU and the host RAM first, and among them no offload before optimizer offload
    before parameter offload before NVMe (each costs step time), then by estimated peak memory."""
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
