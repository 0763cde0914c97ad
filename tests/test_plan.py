"""launch/check_plan.py: one broken plan per ERROR class, sound profiles, --json, --suggest, light imports."""

import argparse
import dataclasses
import json
import re
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

import launch.check_plan as check_plan

ROOT = Path(__file__).resolve().parents[1]
XL_3080 = ["--profile", "rtx3080_10gb"]


def run(capsys, *argv: str) -> tuple[int, str]:
    code = check_plan.main(list(argv))
    return code, capsys.readouterr().out


def ds_file(tmp_path, **changes) -> str:
    config = json.loads((ROOT / "ds_configs/zero2.json").read_text())
    for key, value in changes.items():
        config[key] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


def model_dir(tmp_path, **fields) -> str:
    config = {
        "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 128, "concept_num": 8, "max_position_embeddings": 512,
    }  # fmt: skip
    config.update(fields)
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def tokenizer_dir(tmp_path, vocab: int, specials: dict) -> str:
    path = tmp_path / "tok"
    path.mkdir()
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(vocab)}}}))
    (path / "special_tokens_map.json").write_text(json.dumps(specials))
    return str(path)


def checkpoint_dir(tmp_path, manifest: dict | None = None) -> str:
    """A checkpoint folder as the loop writes it (train state, a manifest of its files: none by default)."""
    path = tmp_path / "runs" / "r1" / "checkpoints" / "step_0000010"
    path.mkdir(parents=True, exist_ok=True)
    (path / "train_state.json").write_text("{}")
    (path / "manifest.json").write_text(json.dumps(manifest or {}))
    return str(path)


BROKEN = {
    "batch arithmetic": (
        lambda t: ["--profile", "cpu", "--ds_config", ds_file(t, train_micro_batch_size_per_gpu=4)],
        "train_micro_batch_size_per_gpu=4 but the plan gives 8",
    ),
    "world size vs GPUs": (lambda t: ["--gpus", "2", "--num_processes", "4"], "4 processes but only 2 GPUs"),
    "ZeRO / offload": (
        lambda t: ["--ds_config", ds_file(t, zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}})],
        "offload_param needs ZeRO stage 3",
    ),
    "NVMe path (offload_optimizer)": (
        lambda t: ["--ds_config", "ds_configs/zero3_nvme.json"],
        "/REPLACE/WITH/FAST/NVME/PATH does not exist",
    ),
    "host RAM": (lambda t: [*XL_3080, "--host_memory", "4GB"], "of 4.0 GiB per machine"),
    "precision": (
        lambda t: ["--ds_config", ds_file(t, bf16={"enabled": True}, fp16={"enabled": True})],
        "both bf16 and fp16",
    ),
    "bf16 capability": (
        lambda t: ["--mixed_precision", "bf16", "--gpus", "1", "--gpu_memory", "16GB", "--gpu_capability", "7.5"],
        "bf16 needs compute capability >= 8.0",
    ),
    "hidden % heads": (
        lambda t: ["--model_name_or_path", model_dir(t, hidden_size=30, num_attention_heads=4)],
        "hidden_size=30 is not divisible by 4 heads",
    ),
    "sequence length": (
        lambda t: ["--model_name_or_path", model_dir(t, max_position_embeddings=64), "--max_seq_length", "128"],
        "max_seq_length=128 > max_position_embeddings=64",
    ),
    "tokenizer specials": (
        lambda t: ["--tokenizer", tokenizer_dir(t, 100, {"pad_token": "[PAD]"})],
        "has no mask token",
    ),
    "vocabulary": (
        lambda t: [
            "--tokenizer",
            tokenizer_dir(t, 2000, {"pad_token": "[PAD]", "mask_token": "[MASK]"}),
            "--model_name_or_path",
            model_dir(t),
        ],
        "tokenizer has 2000 tokens, the model's vocab_size is 1000",
    ),  # fmt: skip
    "dataset": (lambda t: ["--dataset", "./no/such/corpus.txt"], "no such file or folder"),
    "output dir": (lambda t: ["--output_dir", str(Path(__file__)) + "/runs"], "is a file, not a folder"),
    "resume missing": (lambda t: ["--resume_from_checkpoint", str(t / "nothing")], "not a checkpoint folder"),
    "resume not a checkpoint": (lambda t: ["--resume_from_checkpoint", str(t)], "not a checkpoint folder"),
    "resume damaged": (
        lambda t: ["--resume_from_checkpoint", checkpoint_dir(t, manifest={"model.safetensors": 10})],
        "is damaged: model.safetensors is missing",
    ),
    "output dir is the resume dir": (
        lambda t: ["--resume_from_checkpoint", checkpoint_dir(t), "--output_dir", checkpoint_dir(t)],
        "is (inside) the checkpoint being resumed",
    ),
    "GPU memory": (lambda t: [*XL_3080, "--gpu_memory", "3GB"], "GiB budget"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_error_class_exits_1_with_its_reason(case, tmp_path, capsys):
    make_args, reason = BROKEN[case]
    code, out = run(capsys, *make_args(tmp_path))
    assert code == 1, out
    error_lines = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert any(reason in line for line in error_lines), f"{reason!r} not in:\n{out}"


def test_cpu_adam_unbuildable_is_an_error(monkeypatch, capsys):
    monkeypatch.setattr(check_plan.shutil, "which", lambda name: None)
    code, out = run(capsys, *XL_3080)
    assert code == 1 and "no C++ compiler (g++) to JIT-build CPU Adam" in out


@pytest.mark.parametrize("profile", ["cpu", "single_gpu", "rtx3080_10gb", "rtx3090_24gb", "multi_gpu", "multi_node"])
def test_every_profile_is_a_sound_plan(profile, capsys):
    code, out = run(capsys, "--profile", profile)
    assert code == 0, out
    assert "plan is sound" in out
    command = out.strip().splitlines()[-1].strip()
    assert command.startswith("accelerate launch --config_file launch/") and "loops/mlm.py" in command


def test_the_verdict_names_the_host_memory_beside_the_gpu_memory(capsys):
    """xl on the 3080 profile fits 10 GB of GPU with ~25 GiB of host RAM (the process, its fp32 model, the
    offloaded states): sound with the profile's 32 GB, refused with 24 GB, and the verdict says both."""
    code, out = run(capsys, *XL_3080)
    assert code == 0 and re.search(r"plan is sound \(~7\.\d GiB of 10 GiB GPU, ~25\.\d GiB of 32 GiB host RAM\)", out)
    assert "1 process × (0.6 baseline + 3.6 fp32 model) + 21.3 offloaded states) of 32.0 GiB per machine" in out
    code, out = run(capsys, *XL_3080, "--host_memory", "24GB")
    assert code == 1 and re.search(
        r"1 error\(s\): .* \(~7\.\d GiB of 10 GiB GPU, ~25\.\d GiB of 24 GiB host RAM\)", out
    )


def test_json_has_one_entry_per_check(capsys):
    code, out = run(capsys, *XL_3080, "--json")
    data = json.loads(out)
    assert code == 0 and data["errors"] == 0
    names = [c["name"] for c in data["checks"]]
    assert len(names) == len(set(names)) and {"batch arithmetic", "GPU memory", "precision"} <= set(names)
    assert all(c["status"] in ("OK", "WARNING", "ERROR") for c in data["checks"])
    assert data["command"].startswith("accelerate launch")


def test_suggest_orders_by_offload_then_estimated_memory(capsys):
    code, out = run(capsys, *XL_3080, "--preset", "large", "--suggest", "--json")
    rows = json.loads(out)["suggest"]
    assert {r["ds_config"] for r in rows} >= {"zero0", "zero2", "zero2_offload", "zero3_offload"}
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True)  # everything that fits comes first
    level = {"none": 0, "optimizer": 1, "params+optimizer": 2, "nvme": 3}
    fitting = [r for r in rows if r["fits"]]
    assert [level[r["offload"]] for r in fitting] == sorted(level[r["offload"]] for r in fitting)
    for lvl in level.values():
        peaks = [r["est_gpu_peak_gib"] for r in fitting if level[r["offload"]] == lvl]
        assert peaks == sorted(peaks)
    xl = json.loads(run(capsys, *XL_3080, "--suggest", "--json")[1])["suggest"]
    assert [r["ds_config"] for r in xl if r["fits"]][0] == "zero2_offload"  # xl needs offload on 10 GB


PLAN_3B = [*XL_3080, "--preset", "3b", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "32",
           "--gradient_checkpointing"]  # fmt: skip


def test_3b_preset_counts_equal_the_model_built_on_the_meta_device():
    import torch

    from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
    from concept_encoder.accounting.memory import parameter_count

    config = config_from_preset("3b", vocab_size=30522)
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = ConceptEncoderForMaskedLM(config)
    built = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert parameter_count(**config.to_dict())["total"] == built and 2.9e9 < built < 3.3e9


def test_3b_plan_on_a_10gb_card_equals_deepspeeds_estimator_and_goes_to_nvme_when_host_ram_is_short(capsys):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    from concept_encoder.accounting.memory import GIB, PROCESS_BASELINE_BYTES

    capsys.readouterr()  # DeepSpeed's first import prints its accelerator to stdout
    code, out = run(capsys, *PLAN_3B, "--ds_config", "ds_configs/zero3_offload.json", "--suggest", "--json")
    data = json.loads(out)
    params, largest = data["estimate"]["parameters"], data["estimate"]["largest_layer"]
    assert 2.9e9 < params < 3.3e9
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(params, largest, 1, 1, True, True, zero_init=True)
    assert data["estimate"]["gpu_model_states_gib"] == pytest.approx(gpu / GIB, abs=1e-3)
    assert data["estimate"]["cpu_model_states_gib"] == pytest.approx(cpu / GIB, abs=1e-3)
    rows = {r["ds_config"]: r for r in data["suggest"]}
    # the host holds the offloaded states and the process's baseline (no fp32 model: zero.Init builds it on the GPU)
    assert rows["zero3_offload"]["est_host_gib"] == pytest.approx((cpu + PROCESS_BASELINE_BYTES) / GIB, abs=0.01)
    # 32 GB of host RAM (the profile) cannot hold ~78 GiB of offloaded states: NVMe is what fits
    assert not rows["zero3_offload"]["fits"] and rows["zero3_offload"]["why_not"] == "host RAM"
    assert rows["zero3_nvme"]["fits"] and rows["zero3_nvme"]["est_nvme_gib"] == pytest.approx(cpu / GIB, abs=0.01)
    assert [r["ds_config"] for r in data["suggest"] if r["fits"]] == ["zero3_nvme"]
    assert code == 1  # the plan's own ds config (zero3_offload) is refused on host RAM
    assert any(c["name"] == "host RAM" and c["status"] == "ERROR" for c in data["checks"])
    big_host = json.loads(run(capsys, *PLAN_3B, "--host_memory", "128GB", "--suggest", "--json")[1])["suggest"]
    assert [r["ds_config"] for r in big_host if r["fits"]][:2] == ["zero2_offload", "zero3_offload"]


def test_usage_errors_exit_2(capsys):
    assert check_plan.main(["--profile", "no_such_profile"]) == 2
    assert "unknown profile 'no_such_profile'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        check_plan.main(["--num_processes", "many"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--learning_rate", "-1"], "learning_rate=-1.0 must be > 0"),
        (
            ["--masking", "bogus"],
            "masking='bogus' is unknown; choose one of ('mlm', 'whole_word', 'span', 'query_values')",
        ),
        (["--no-such-flag"], "unknown argument(s) ['--no-such-flag']"),
        (["--preset", "huge"], "preset='huge' is unknown"),
        (["--concept_losses", "orthogonal"], "unknown concept loss(es) ['orthogonal']"),
    ],
)
def test_values_the_loop_rejects_are_usage_errors_with_the_loops_message(argv, message, capsys):
    from concept_encoder.training.args import parse_args

    with pytest.raises(ValueError) as loop_error:
        parse_args(argv)
    assert message in str(loop_error.value)
    assert check_plan.main(["--profile", "rtx3080_10gb", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"usage error: {loop_error.value}" and "plan is sound" not in captured.out


def loop_help_flags() -> set[str]:
    """The flags `python loops/mlm.py --help` lists (underscore spellings)."""
    out = subprocess.run(
        [sys.executable, "loops/mlm.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_]*)(?![\w-])", out.stdout)) - {"--help"}


def test_every_flag_of_the_loop_is_accepted_with_the_loops_default(capsys):
    from concept_encoder.common.dataclass_args import build_parser
    from concept_encoder.training.args import ARGUMENT_CLASSES, parse_args

    parser = build_parser(ARGUMENT_CLASSES)
    options = {option: action for action in parser._actions for option in action.option_strings}
    flags = loop_help_flags()
    assert flags == {o for o in options if o.startswith("--") and "-" not in o[2:]} - {"--help"}, "--help lists it"
    plan = json.loads(run(capsys, "--json")[1])["plan"]
    resolved = {**plan["model"], **plan["data"], **plan["train"]}
    loop_defaults = {k: v for parsed in parse_args([]) for k, v in dataclasses.asdict(parsed).items()}
    checked = 0
    for flag in sorted(flags - {"--config"}):
        action = options[flag]
        assert resolved[action.dest] == loop_defaults[action.dest], flag  # same default (and default recipe)
        if isinstance(action, argparse._StoreFalseAction) or action.default in (None, []):
            value = (
                [] if isinstance(action, argparse._StoreFalseAction) else None
            )  # nothing equals an unset/empty default
        else:
            value = [str(action.default).lower() if isinstance(action.default, bool) else str(action.default)]
        if value is None:
            continue  # no value to pass that equals an unset default
        code, out = run(capsys, flag, *value, "--json")
        assert code == 0, (flag, out)
        got = {
            **json.loads(out)["plan"]["model"],
            **json.loads(out)["plan"]["data"],
            **json.loads(out)["plan"]["train"],
        }
        assert got[action.dest] == (False if value == [] else action.default), flag
        checked += 1
    assert checked > 40


def test_profile_loop_defaults_then_yaml_config_then_flags(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("per_device_train_batch_size: 4\nlearning_rate: 0.002\n")
    plan = json.loads(run(capsys, *XL_3080, "--json")[1])["plan"]
    assert (plan["model"]["preset"], plan["train"]["per_device_train_batch_size"]) == ("xl", 8)  # the profile's
    plan = json.loads(run(capsys, *XL_3080, "--config", str(config), "--json")[1])["plan"]
    assert plan["train"]["per_device_train_batch_size"] == 4 and plan["train"]["learning_rate"] == 0.002
    plan = json.loads(run(capsys, *XL_3080, "--config", str(config), "--per_device_train_batch_size", "2", "--json")[1])
    assert plan["plan"]["train"]["per_device_train_batch_size"] == 2 and plan["plan"]["model"]["preset"] == "xl"


def test_the_launch_command_reparses_to_the_checked_plan(capsys):
    from concept_encoder.training.args import parse_args

    argv = [*XL_3080, "--preset", "large", "--learning_rate", "3e-4", "--concept_losses", "uniformity", "--json"]
    data = json.loads(run(capsys, *argv)[1])
    command = shlex.split(data["command"])
    loop_argv = command[command.index("loops/mlm.py") + 1 :]
    model, data_args, train = parse_args(loop_argv)
    assert asdict(model) == data["plan"]["model"] and asdict(train) == data["plan"]["train"]
    assert asdict(data_args) == data["plan"]["data"]
    assert train.learning_rate == 3e-4 and model.preset == "large" and train.per_device_train_batch_size == 8


def test_static_checks_import_no_torch():
    code = (
        "import runpy, sys\n"
        "sys.argv = ['check_plan.py', '--profile', 'rtx3080_10gb']\n"
        "try:\n    runpy.run_path('launch/check_plan.py', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "heavy = ('torch', 'deepspeed', 'accelerate', 'datasets', 'transformers.modeling_utils')\n"
        "print('HEAVY', sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout


def test_resuming_into_the_runs_folder_is_sound(tmp_path, capsys):
    code, out = run(
        capsys, "--resume_from_checkpoint", checkpoint_dir(tmp_path), "--output_dir", str(tmp_path / "runs")
    )
    assert code == 0, out
    assert "the run continues in" in out


def test_impossible_machines_are_errors_and_run_checks_the_machine_it_is_on(monkeypatch, capsys):
    assert check_plan.main(["--profile", "rtx3080_10gb", "--gpus", "0"]) == 1
    assert "0 GPUs per machine, but the plan budgets 10 GiB per GPU" in capsys.readouterr().out
    for bad in (["--nodes", "0"], ["--num_processes", "0"], ["--gpus", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            check_plan.main(["--profile", "cpu", *bad])
        assert exit_info.value.code == 2 and "is below" in capsys.readouterr().err

    launched = []
    monkeypatch.setattr(
        check_plan.process_group, "call_interrupting_ranks", lambda command: launched.append(command) or 0
    )
    monkeypatch.setattr(check_plan.os, "chdir", lambda path: None)
    monkeypatch.setattr(check_plan, "visible_gpus", lambda: [])
    assert check_plan.main(["--profile", "rtx3080_10gb", "--run"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs 1 GPU with 10 GB per machine; this machine has none" in err
    assert "on this machine: make train-cpu" in err and launched == []
    monkeypatch.setattr(
        check_plan, "visible_gpus", lambda: [{"name": "RTX 3090", "memory_gb": 24.0, "capability": 8.6}]
    )
    assert check_plan.main(["--profile", "rtx3080_10gb", "--run"]) == 0  # fits: launched
    assert launched and "loops/mlm.py" in launched[0]
    launched.clear()
    monkeypatch.setattr(check_plan, "visible_gpus", lambda: [{"name": "RTX 3070", "memory_gb": 8.0, "capability": 8.6}])
    assert check_plan.main(["--profile", "rtx3080_10gb", "--run"]) == 1 and not launched
    assert "this machine has 1 GPU with 8 GB; on this machine: make train-cpu" in capsys.readouterr().err


def test_the_built_in_corpora_are_offline_and_their_folders_checked(tmp_path, capsys):
    for corpus in ("embedded", "docstrings", "licenses", "modules", f"modules:{tmp_path}"):
        code, out = run(capsys, "--profile", "cpu", "--dataset", corpus, "--json")
        [check] = [c for c in json.loads(out)["checks"] if c["name"] == "dataset"]
        assert check["status"] == "OK" and "no network" in check["reason"], (corpus, check)
    code, out = run(capsys, "--profile", "cpu", "--dataset", f"modules:{tmp_path / 'missing'}", "--json")
    [check] = [c for c in json.loads(out)["checks"] if c["name"] == "dataset"]
    assert code == 1 and check["status"] == "ERROR" and "missing" in check["reason"]


def test_a_mixture_is_checked_part_by_part(tmp_path, capsys):
    code, out = run(capsys, "--profile", "cpu", "--dataset", "docstrings,task:embedded*8", "--json")
    [check] = [c for c in json.loads(out)["checks"] if c["name"] == "dataset"]
    assert check["status"] == "OK" and "docstrings x1, task:embedded x8" in check["reason"], check
    code, out = run(capsys, "--profile", "cpu", "--dataset", "embedded,./no/such.txt*2", "--json")
    [check] = [c for c in json.loads(out)["checks"] if c["name"] == "dataset"]
    assert code == 1 and check["status"] == "ERROR" and "./no/such.txt: no such file or folder" in check["reason"]
