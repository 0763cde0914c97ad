"""The loops' argument parser and the rules derived from it (concept_encoder.training.args / .plan)."""

from pathlib import Path

import pytest

from concept_encoder.common.dataclass_args import to_argv
from concept_encoder.model.presets import PRESETS
from concept_encoder.training.args import parse_args
from concept_encoder.training.plan import deepspeed_batch_values, fresh_model_fields, launch_command


def test_to_argv_reparses_to_the_same_arguments_booleans_and_floats_included():
    argv = ["--preset", "tiny", "--packing", "false", "--gradient_checkpointing", "--learning_rate", "3e-4",
            "--concept_losses", "uniformity,nn_spread", "--mixed_precision", "bf16", "--max_eval_batches", "2"]  # fmt: skip
    parsed = parse_args(argv)
    flags = to_argv(*parsed)
    assert parse_args(flags) == parsed
    assert "--packing" in flags and "--seed" not in flags  # only values that differ from the defaults


def test_defaults_then_yaml_then_flags(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 0.002\nmax_steps: 7\n")
    defaults = {"learning_rate": 0.1, "max_steps": 3, "preset": "micro"}
    model, _, train = parse_args(["--config", str(config), "--max_steps", "9"], defaults=defaults)
    assert (model.preset, train.learning_rate, train.max_steps) == ("micro", 0.002, 9)
    with pytest.raises(ValueError, match=r"defaults: unknown keys \['micro_batch'\]"):
        parse_args([], defaults={"micro_batch": 8})
    config.write_text("seq_len: 64\n")
    with pytest.raises(ValueError, match=r"unknown keys \['seq_len'\]; valid keys are"):
        parse_args(["--config", str(config)])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--adam_beta2", "1.0"], "adam_beta2=1.0 must be in [0, 1)"),
        (["--max_grad_norm", "-1"], "max_grad_norm=-1.0 must be >= 0"),
        (["--loss_weighting", "kendall_gal", "--concept_loss_warmup_steps", "5"], "weighting='fixed' only"),
        (["--concept_losses", "uniformity,uniformity"], "listed more than once"),
        (["--decoder_type", "dense"], "decoder_type='dense' is unknown"),
        (["--max_eval_batches", "0"], "max_eval_batches=0 must be >= 1"),
    ],
)
def test_bad_values_are_rejected_at_parse_time(argv, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        parse_args(argv)


def test_position_table_grows_to_the_sequence_length_and_overrides_apply():
    model, _, _ = parse_args(["--preset", "small", "--concept_num", "16", "--hidden_dropout_prob", "0"])
    grown = fresh_model_fields(model, 1024, vocab_size=8000, pad_token_id=0)
    assert grown["max_position_embeddings"] == 1024 > PRESETS["small"]["max_position_embeddings"]
    assert (grown["concept_num"], grown["hidden_dropout_prob"], grown["vocab_size"], grown["pad_token_id"]) == (
        16, 0.0, 8000, 0,
    )  # fmt: skip
    kept = fresh_model_fields(model, 128, vocab_size=8000)
    assert kept["max_position_embeddings"] == PRESETS["small"]["max_position_embeddings"]


def test_a_fresh_models_position_table_covers_its_longest_padded_batch():
    from concept_encoder.data.tokenizer import load_tokenizer
    from concept_encoder.training.model import build_model

    model_args, data_args, _ = parse_args(
        ["--preset", "micro", "--max_seq_length", "520", "--pad_to_multiple_of", "64"]
    )
    assert PRESETS["micro"]["max_position_embeddings"] < 520
    model = build_model(model_args, data_args, load_tokenizer("listops"))
    assert model.config.max_position_embeddings == 576  # 520 rounded up to 64: a batch of the longest inputs


def test_deepspeed_batch_values_and_launch_command():
    model, data, train = parse_args(["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "3"])
    assert deepspeed_batch_values(train, world_size=2) == {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "train_batch_size": 24,
    }  # fmt: skip
    command = launch_command(["--num_processes", "2"], model, data, train)
    assert command == ["accelerate", "launch", "--num_processes", "2", "loops/mlm.py",
                       "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "3"]  # fmt: skip


def test_cache_is_the_projects_wherever_a_command_starts(tmp_path, monkeypatch):
    from concept_encoder.common.paths import PROJECT_ROOT, cache_path
    from concept_encoder.common.report_files import claim_report_stem
    from concept_encoder.training.plan import launch_command

    monkeypatch.delenv("CONCEPT_ENCODER_CACHE")
    monkeypatch.chdir(tmp_path)  # started from another folder: the defaults still mean the checkout's Cache/
    assert cache_path("Cache/runs") == PROJECT_ROOT / "Cache" / "runs" and cache_path("runs") == Path("runs")
    parsed = parse_args([])
    assert parsed[2].output_dir == str(PROJECT_ROOT / "Cache" / "runs")
    assert "--output_dir" not in launch_command([], *parsed)  # still the default
    assert parse_args(["--output_dir", "elsewhere"])[2].output_dir == "elsewhere"
    monkeypatch.setenv("CONCEPT_ENCODER_CACHE", str(tmp_path / "shared"))
    assert parse_args([])[2].output_dir == str(tmp_path / "shared" / "runs")
    assert claim_report_stem("Cache/reports", "x").parent == tmp_path / "shared" / "reports"
    assert not (tmp_path / "Cache").exists()


def test_a_setting_given_twice_in_a_yaml_config_is_refused_naming_it(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 1e-3\nmax_steps: 10\nlearning_rate: 5e-4\n")
    with pytest.raises(ValueError, match="duplicate key 'learning_rate': give each setting once"):
        parse_args(["--config", str(config)])


def test_an_argument_set_applies_its_own_rule_after_each_class_and_to_argv_leaves_resolved_defaults_out():
    from dataclasses import dataclass, field

    from concept_encoder.common.dataclass_args import ArgumentSet, parse_dataclasses, resolve_default
    from concept_encoder.training.args import ARGUMENT_CLASSES, FINETUNE_ARGUMENT_CLASSES

    @dataclass
    class Sizes:
        width: int = 4
        depth: int | None = None

    @dataclass
    class Budget:
        steps: int = 10
        tags: list[str] = field(default_factory=list)

    def rule(sizes: Sizes, budget: Budget) -> None:
        if sizes.width * budget.steps > 100:
            raise ValueError(f"width {sizes.width} x steps {budget.steps} is over budget")
        if sizes.depth is None:
            resolve_default(sizes, "depth", sizes.width // 2)

    with_rule = ArgumentSet((Sizes, Budget), rule, repeatable=("--tags",))
    sizes, budget = parse_dataclasses(["--width", "8", "--tags", "a", "--steps", "12", "--tags", "b"], with_rule)
    assert (sizes.depth, budget.steps, budget.tags) == (4, 12, ["a", "b"])
    assert to_argv(sizes, budget) == ["--width", "8", "--steps", "12", "--tags", "a", "b"]  # depth was resolved
    with pytest.raises(ValueError, match="width 20 x steps 10 is over budget"):
        parse_dataclasses(["--width", "20"], with_rule)
    assert parse_dataclasses(["--width", "20"], (Sizes, Budget))[0].depth is None  # a plain tuple has no rule
    assert ARGUMENT_CLASSES.rule is not FINETUNE_ARGUMENT_CLASSES.rule  # each loop's set checks its own rules
    with pytest.raises(ValueError, match="give --learning_rates 0.001 for one fixed rate"):
        parse_args(["--model_name_or_path", ".", "--learning_rate", "1e-3"], classes=FINETUNE_ARGUMENT_CLASSES)


def test_no_float_setting_takes_infinity_or_nan(tmp_path):
    for flag in ("--learning_rate", "--weight_decay", "--concept_loss_weight", "--warmup_ratio"):
        for value in ("inf", "nan", "-inf"):
            with pytest.raises(ValueError, match=f"{flag[2:]}={float(value)!r} must be a finite number"):
                parse_args([f"{flag}={value}"])
    config = tmp_path / "run.yaml"
    config.write_text("max_grad_norm: .inf\n")  # YAML's infinity
    with pytest.raises(ValueError, match="max_grad_norm=inf must be a finite number"):
        parse_args(["--config", str(config)])


@pytest.mark.parametrize(
    "flags",
    [["--objective", "diffusion"], ["--t_min", "0.5"], ["--deletion_rate", "0.9"], ["--loss_weighting", "learnable"],
     ["--concept_loss_weight", "5"], ["--concept_losses", "orthogonality"], ["--snapshot_steps", "2"],
     ["--concept_loss_warmup_steps", "3"], ["--diffusion_weighting", "none"]],
)  # fmt: skip
def test_fine_tuning_refuses_every_pretraining_only_setting_instead_of_recording_it(flags):
    from concept_encoder.training.args import FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS, PRETRAINING_ONLY

    assert flags[0][2:] in PRETRAINING_ONLY
    with pytest.raises(ValueError, match=rf"does not support \['{flags[0]}'\] \(they are for pretraining\)"):
        parse_args(["--model_name_or_path", "m", "--task", "embedded", *flags], classes=FINETUNE_ARGUMENT_CLASSES,
                   defaults=FINETUNE_DEFAULTS)  # fmt: skip
