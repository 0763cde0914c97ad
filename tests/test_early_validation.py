"""Bad arguments are refused in one line before any expensive work: every tool's numbers range-checked,
a DeepSpeed config out of range (plan checker and loop alike), arguments the loop checks before building data or
a model, and the script before it imports torch. (A YAML key given twice: test_args.py; plans this machine cannot
run: test_plan.py.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from loop_runs import ROOT, fresh_accelerate, run, workdir  # noqa: F401 (fixtures)


@pytest.mark.parametrize(
    ("tool", "argv", "message"),
    [
        ("check_health", ["some/model", "--batches", "0"], "argument --batches: 0 is below 1"),
        ("check_health", ["some/model", "--batch_size", "two"], "argument --batch_size: 'two' is not a whole number"),
        ("data", ["--seed", "-1"], "argument --seed: -1 is below 0"),
        ("data", ["--document_blocks", "true", "--packing", "false"], "document_blocks=True cuts documents into"),
        ("ablate", ["--vary", "a=1,2", "--decide", "eval_loss", "--num_processes", "0"], "--num_processes: 0 is below"),
        ("zero_compare", ["--steps", "0"], "argument --steps: 0 is below 1"),
        ("check_plan", ["--num_processes", "0"], "argument --num_processes: 0 is below 1"),
        ("presets", ["--vocab_size", "-5"], "argument --vocab_size: -5 is below 1"),
    ],
)
def test_every_tool_range_checks_its_numbers_in_one_line(tool, argv, message, capsys):
    import importlib

    modules = {"check_health": "concept_encoder.decide.check_health", "data": "concept_encoder.data.__main__",
               "ablate": "concept_encoder.decide.ablate", "zero_compare": "launch.zero_compare", "check_plan": "launch.check_plan",
               "presets": "concept_encoder.model.summary"}  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(modules[tool]).main(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_a_ds_config_out_of_range_is_one_line_for_the_plan_checker_and_the_loop(tmp_path, monkeypatch, capsys):
    from launch import check_plan

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 4, "offload_param": {"device": "gpu"}},
                               "train_micro_batch_size_per_gpu": 0}))  # fmt: skip
    assert check_plan.main(["--profile", "cpu", "--ds_config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "zero_optimization.stage=4 must be 0, 1, 2 or 3" in err and "offload_param.device='gpu'" in err
    assert "train_micro_batch_size_per_gpu=0 must be a number >= 1" in err
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch --deepspeed_config_file` sets
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(bad))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match="the DeepSpeed config of this launch is out of range: zero_optimization.stage=4"
    ):
        run("--run_name", "bad-ds")
    assert not Path("runs/bad-ds").exists()


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda t: ["--config", str(yaml_file(t, "max_steps: 3.7\n"))], "max_steps=3.7 must be an int"),
        (lambda t: ["--pad_to_multiple_of", "0"], "pad_to_multiple_of=0 must be >= 1"),
        (lambda t: ["--output_dir", str(yaml_file(t, "")) + "/runs"], "is a file, not a folder"),
        (lambda t: ["--mixed_precision", "fp16"], "fp16 needs a CUDA GPU and this run is on the CPU"),
        (
            lambda t: ["--model_name_or_path", str(t), "--max_seq_length", "64", "--preset", "small"],
            "exceeds the model's max_position_embeddings=32",
        ),
        (
            lambda t: [
                "--model_name_or_path",
                str(t),
                "--max_seq_length",
                "30",
                "--pad_to_multiple_of",
                "20",
                "--preset",
                "small",
            ],
            "--pad_to_multiple_of 20 pads a batch of max_seq_length=30 tokens to 40, past the model's 32 positions",
        ),
        (lambda t: ["--resume_from_checkpoint", str(t / "nothing")], "not a checkpoint folder"),
        (lambda t: ["--run_name", "../escaped"], "cannot be a run folder: a run name is one folder name under"),
        (lambda t: ["--run_name", str(t / "abs")], "cannot be a run folder"),
        (lambda t: ["--concept_num", "100000"], "this run needs about [0-9,.]+ GiB of memory .*100000 concepts"),
        (lambda t: ["--model_name_or_path", str(t), "--concept_num", "4"], "shape a fresh model; --model_name_or_path"),
        (lambda t: ["--per_device_train_batch_size", "2000000"], "activations [0-9,.]+ GiB each, at batch 2000000"),
        (lambda t: ["--tokenizer", "listops"], "--tokenizer listops knows only the symbols of listops tasks"),
    ],
    ids=[
        "yaml-float-steps",
        "pad-multiple",
        "output-dir",
        "fp16-on-cpu",
        "positions",
        "padded-past-positions",
        "resume-path",
        "run-name-up",
        "run-name-absolute",
        "concepts-beyond-memory",
        "batch-beyond-memory",
        "shape-beside-a-model-folder",
        "listops-tokenizer-on-text",
    ],  # fmt: skip
)
def test_bad_arguments_fail_before_data_and_model_are_built(tmp_path, monkeypatch, make_args, message):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "concept_encoder", "max_position_embeddings": 32}))
    argv = make_args(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match=message if "GiB" in message else message.replace("(", r"\(").replace(")", r"\)")
    ):
        run("--run_name", "bad", *argv)
    assert not Path("Cache/datasets").exists() and not Path("Cache/tokenizers").exists()
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "abs").exists()


def test_a_gpu_torch_cannot_use_is_refused_by_the_loop_before_anything_is_built(tmp_path, monkeypatch):
    """The driver's GPU is seen by the loop's own preflight (step 4, with the device it got: the CPU), before the
    data, the model or a run folder; `--allow_cpu` and the unit cases: test_machine_checks.py."""
    import torch

    from concept_encoder.machine import checks as machine_checks

    monkeypatch.setattr(machine_checks, "driver_gpu", lambda: machine_checks.DriverGpu("550.54.15", "12.4"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for chosen_cpu in ("CUDA_VISIBLE_DEVICES", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(chosen_cpu, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^the NVIDIA driver sees a GPU \(nvidia-smi: driver 550.54.15, CUDA 12.4\)"):
        run("--run_name", "unseen-gpu")
    assert not Path("runs/unseen-gpu").exists() and not Path("Cache/datasets").exists()


def yaml_file(folder: Path, text: str) -> Path:
    path = folder / "run.yaml"
    path.write_text(text)
    return path


def test_the_script_rejects_a_bad_argument_before_importing_torch(tmp_path):
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{str(ROOT / 'loops/mlm.py')!r}, '--pad_to_multiple_of', '0']\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n    print('EXIT', e.code, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "EXIT 1 False" in out.stdout
    assert out.stderr.startswith("error: pad_to_multiple_of=0 must be >= 1") and "Traceback" not in out.stderr


def test_check_health_refuses_a_json_path_it_cannot_write_before_loading_anything(tmp_path, capsys):
    from concept_encoder.decide import check_health

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "concept_encoder"}))
    (tmp_path / "model" / "model.safetensors").write_bytes(b"")  # never read: the --json check comes first
    assert check_health.main([str(tmp_path / "model"), "--json", str(tmp_path)]) == 2  # a folder, not a file
    err = capsys.readouterr().err
    assert f"--json {tmp_path} is a folder; give a file name" in err and err.count("\n") == 1
    (tmp_path / "a-file").write_text("x")
    assert check_health.main([str(tmp_path / "model"), "--json", str(tmp_path / "a-file" / "out.json")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_check_health_refuses_a_tokenizer_larger_than_the_models_vocabulary(tmp_path, capsys, monkeypatch):
    from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
    from concept_encoder.decide import check_health

    monkeypatch.chdir(tmp_path)
    ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=64)).save_pretrained(tmp_path / "small-vocab")
    capsys.readouterr()
    argv = [str(tmp_path / "small-vocab"), "--tokenizer", "train:wordpiece:2000", "--max_seq_length", "32"]
    assert check_health.main(argv) == 2
    err = capsys.readouterr().err
    [error] = [line for line in err.splitlines() if line.startswith("error:")]  # beside progress bars and logs
    assert "model vocab_size=64 is smaller than the tokenizer" in error and "Traceback" not in err


LONG = "/tmp/" + "d" * 300  # a name longer than the system allows: looking it up raises instead of answering


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("concept_encoder.decide.check_health", [LONG]),
        ("concept_encoder.decide.compare", [LONG]),
        ("concept_encoder.decide.curve", ["--tokens", "1M", "--task", LONG + ".csv"]),
        ("concept_encoder.decide.reference", ["--wheel", LONG]),
    ],
)
def test_a_path_the_system_refuses_is_one_line_in_every_tool(module, argv, capsys):
    import importlib

    from concept_encoder.common.entry import run_tool

    try:
        code = run_tool(importlib.import_module(module).main, module, argv)
    except SystemExit as exit:  # the tool's own usage error
        code = exit.code
    err = capsys.readouterr().err
    assert code in (1, 2) and "Traceback" not in err
    assert "File name too long" in err or "not a usable path" in err, err


def test_a_path_the_system_refuses_is_one_line_before_the_loop_imports_torch(capsys):
    from concept_encoder.training.preflight import fail_fast

    with pytest.raises(SystemExit) as refused:
        fail_fast(["--output_dir", LONG])
    assert refused.value.code == 1
    assert f"--output_dir {LONG}: not a usable path (File name too long)" in capsys.readouterr().err
