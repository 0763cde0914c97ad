"""Flags and cached files that could only fail late, refused before anything expensive runs, in one line that names
the flag or file, what is wrong and the fix (issue 55): schedule settings a schedule ignores, non-finite numbers and
time budgets, profiler ranges that cannot happen or cannot be written, a tokenizer with nothing to mask, malformed
generated-task caches, and generator settings that could never finish."""

import json
import logging
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from concept_encoder.common.padding import padded_length
from concept_encoder.decide.experiments import parse_choices
from concept_encoder.tasks.generated import MAX_SYMBOLS, cached_splits, generation_problem, read_splits
from concept_encoder.tasks.listops import (
    LONGEST_TREE,
    ListOpsSettings,
    generate_splits,
    length_distribution,
    listops_splits,
    parse_listops,
    window_share,
)
from concept_encoder.training.args import (
    FINETUNE_ARGUMENT_CLASSES,
    FINETUNE_DEFAULTS,
    LR_SCHEDULES,
    WSD_DECAYS,
    parse_args,
    parse_duration,
)
from concept_encoder.training.preflight import (
    fixed_vocabulary_problem,
    maskable_problem,
    profile_folder_problem,
)


def training_args(*flags: str):
    return parse_args(list(flags))[2]


def schedule_flags(kind: str) -> list[str]:
    """The flags a run of schedule `kind` needs besides the setting under test."""
    return ["--lr_scheduler_type", kind, *(["--decay_steps", "10"] if kind == "wsd" else [])]


# --- schedules: every choice checked, a setting the schedule ignores refused ------------------------------------


@pytest.mark.parametrize("kind", LR_SCHEDULES)
def test_an_unknown_decay_type_is_refused_under_every_schedule(kind):
    with pytest.raises(ValueError, match=r"decay_type='bogus' is unknown; choose one of \('1-sqrt'"):
        training_args(*schedule_flags(kind), "--decay_type", "bogus")


@pytest.mark.parametrize("kind", [k for k in LR_SCHEDULES if k != "wsd"])
@pytest.mark.parametrize("decay", [d for d in WSD_DECAYS if d != "1-sqrt"])
def test_a_known_decay_type_is_refused_where_the_schedule_has_no_decay_of_that_kind(kind, decay):
    with pytest.raises(ValueError, match=rf"--decay_type applies to --lr_scheduler_type wsd only \(this run: {kind}\)"):
        training_args(*schedule_flags(kind), "--decay_type", decay)


@pytest.mark.parametrize(
    ("kind", "flags", "setting"),
    [
        ("constant", ["--min_lr_ratio", "0.1"], "min_lr_ratio"),
        ("linear", ["--decay_steps", "3"], "decay_steps"),
        ("constant", ["--decay_steps", "3"], "decay_steps"),
    ],
)
def test_settings_a_schedule_ignores_are_refused_naming_the_schedules_that_use_them(kind, flags, setting):
    with pytest.raises(ValueError, match=rf"--{setting} applies to --lr_scheduler_type .* only \(this run: {kind}\)"):
        training_args("--lr_scheduler_type", kind, *flags)


FINETUNE_MODEL = ["--model_name_or_path", "some/model", "--task", "embedded"]


def test_a_warmup_ratio_given_beside_warmup_steps_is_refused_by_flag_or_config(tmp_path):
    message = r"--warmup_ratio 0.2 is ignored beside --warmup_steps 10 \(the steps win\): give one of them"
    for flags in (["--warmup_ratio", "0.2"], ["--warmup_rat", "0.2"]):  # argparse's abbreviation is the same flag
        with pytest.raises(ValueError, match=message):
            training_args("--warmup_steps", "10", *flags)
    with pytest.raises(ValueError, match=message):  # fine-tuning's loop too, and `--flag=value`
        parse_args([*FINETUNE_MODEL, "--warmup_steps", "10", "--warmup_ratio=0.2"], FINETUNE_ARGUMENT_CLASSES,
                   FINETUNE_DEFAULTS)  # fmt: skip
    config = tmp_path / "run.yaml"
    config.write_text("warmup_ratio: 0.2\nwarmup_steps: 10\n")
    with pytest.raises(ValueError, match=message):
        training_args("--config", str(config))
    # a default is not a choice: fine-tuning's own warm-up ratio, the budget recipe's, stand beside the steps
    finetune_args = parse_args([*FINETUNE_MODEL, "--warmup_steps", "10"], FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS)
    assert finetune_args[2].num_warmup_steps == 10
    assert training_args("--warmup_steps", "10", "--recipe", "budget").num_warmup_steps == 10
    assert training_args("--warmup_ratio", "0.2", "--max_steps", "100").num_warmup_steps == 20


def test_schedule_settings_left_at_their_defaults_or_where_they_apply_are_accepted():
    for kind in LR_SCHEDULES:
        assert training_args(*schedule_flags(kind)).lr_scheduler_type == kind
    assert training_args(*schedule_flags("wsd"), "--decay_type", "cosine").schedule["decay_type"] == "cosine"
    assert training_args("--min_lr_ratio", "0.1").schedule["min_lr_ratio"] == 0.1  # cosine has a floor


def test_a_wsd_decay_of_no_steps_is_refused_whatever_the_schedule():
    for kind in LR_SCHEDULES:
        with pytest.raises(ValueError, match="decay_steps=0 must be >= 1"):
            training_args("--lr_scheduler_type", kind, "--decay_steps", "0")


# --- non-finite numbers and time budgets ------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["inf", "Infinity", "nan", "-1", "0", "0s", "-5m", "1e999", "9" * 400 + "s"])
def test_a_time_budget_must_be_finite_and_positive(text):
    with pytest.raises(ValueError, match=r"max_time=.* is no duration > 0: .*finite"):
        training_args(f"--max_time={text}")  # = keeps argparse from reading -5m as a flag
    with pytest.raises(ValueError, match="is no duration > 0"):
        parse_duration(text, "max_time")


def test_an_accepted_time_budget_is_finite_and_writes_as_json():
    seconds = training_args("--max_time", "1h30m").max_time_s
    assert math.isfinite(seconds) and json.loads(json.dumps({"budget_s": seconds}, allow_nan=False)) == {
        "budget_s": 5400
    }


@pytest.mark.parametrize(
    "flags",
    [
        ["--learning_rate", "inf"],
        ["--weight_decay", "nan"],
        ["--max_grad_norm", "inf"],
        ["--peak_tflops", "nan"],
        ["--concept_loss_weight", "inf"],
        ["--cuda_memory_budget_gb", "inf"],
    ],
)
def test_a_non_finite_number_is_refused_naming_its_flag(flags):
    with pytest.raises(ValueError, match=rf"{flags[0][2:]}=(nan|inf) must be a finite number"):
        training_args(*flags)


def test_a_non_finite_number_is_refused_in_fine_tuning_too():
    with pytest.raises(ValueError, match=r"epochs=inf must be a finite number"):
        parse_args(["--model_name_or_path", "m", "--task", "embedded", "--epochs", "inf"],
                   classes=FINETUNE_ARGUMENT_CLASSES)  # fmt: skip


# --- profiler ranges and folders ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("7:9", "b=9 is beyond max_steps, which ends the run first"),
        ("5:5", "b=5 is beyond max_steps"),
        ("3:2", "b=2 comes before a=3"),
        ("0:0", "a is 0"),
        ("³:4", "is not a step range a:b"),  # a digit to str.isdigit, not to int()
        ("1:2:3", "is not a step range a:b"),
    ],
)
def test_a_profile_range_that_cannot_happen_is_refused_saying_why(value, reason):
    with pytest.raises(ValueError, match=rf"profile_steps='{value}'.*{reason}"):
        training_args("--max_steps", "4", "--profile_steps", value)


def profiler(steps, run_dir: Path, done: int):
    from concept_encoder.machine.profiling import StepProfiler

    made = StepProfiler(steps, run_dir, main_process=True, done=done)
    if made.profiler is not None:
        made.profiler.stop()  # started: stopped again at once, nothing recorded
    return made


def test_a_profile_range_wholly_before_the_resumed_step_is_said_in_one_line(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="concept_encoder"):
        assert profiler((2, 3), tmp_path, done=5).profiler is None
    (line,) = [r.getMessage() for r in caplog.records if "profile_steps" in r.getMessage()]
    assert "--profile_steps 2:3 was trained before this resume (at step 5): nothing is profiled" in line
    assert "\n" not in line


def test_a_profile_range_partly_before_the_resumed_step_says_what_it_records(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="concept_encoder"):
        made = profiler((2, 6), tmp_path, done=3)
    assert (made.first, made.last) == (4, 6)
    assert any("profiling steps 4-6, the rest of the range" in r.getMessage() for r in caplog.records)


def test_an_unwritable_profile_folder_is_refused_before_any_step(tmp_path):
    (tmp_path / "profile").write_text("a file where the folder goes")
    with pytest.raises(ValueError, match="the profile folder .*profile.* is a file, not a folder"):
        profiler((1, 2), tmp_path, done=0)


def test_preflight_finds_an_unwritable_profile_folder_from_the_arguments(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")  # a file where the run folder goes: writes beneath it fail, root or not
    args = SimpleNamespace(profile_steps="1:2", resume_from_checkpoint=None, output_dir=str(blocker), run_name="r")
    assert "is a file, not a folder; free that path" in profile_folder_problem(args)
    resumed = SimpleNamespace(**{**vars(args), "resume_from_checkpoint": str(blocker / "checkpoints" / "step-2")})
    assert "--profile_steps 1:2: the profile folder" in profile_folder_problem(resumed)
    assert profile_folder_problem(SimpleNamespace(**{**vars(args), "output_dir": str(tmp_path)})) is None
    assert profile_folder_problem(SimpleNamespace(**{**vars(args), "profile_steps": ""})) is None


# --- a tokenizer that cannot serve the objective ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("dataset", "tokenizer", "refused"),
    [
        ("embedded", "listops", True),
        ("docstrings,task:listops:64:200", "listops", True),
        ("task:listops:64:200", "listops", False),
        ("task:listops:64:200*2", "listops", False),
        ("task:recall:8", "recall", False),
        ("task:listops:64:200", "recall", True),
        ("embedded", "recall:64:16", True),
        ("embedded", "train:wordpiece:8000", False),
    ],
)
def test_a_fixed_vocabulary_on_text_it_cannot_read_is_refused_from_the_arguments(dataset, tokenizer, refused):
    problem = fixed_vocabulary_problem(dataset, tokenizer)
    assert (problem is not None) == refused
    if refused:
        assert f"--tokenizer {tokenizer}" in problem and "nothing to mask" in problem and "\n" not in problem


def test_a_local_file_is_given_the_benefit_of_the_doubt(tmp_path):
    corpus = tmp_path / "expressions.txt"
    corpus.write_text("[MAX 2 9 ]\n")
    assert fixed_vocabulary_problem(str(corpus), "listops") is None


def test_the_loop_refuses_a_listops_tokenizer_on_a_text_corpus_before_reading_it():
    with pytest.raises(ValueError, match="--tokenizer listops knows only the symbols of listops tasks"):
        from concept_encoder.training.preflight import preflight

        model_args, data_args, args = parse_args(["--tokenizer", "listops", "--report_to", "none"])
        preflight(model_args, data_args, args, cuda=False)


def test_a_tokenizer_that_reads_the_data_as_unknown_leaves_nothing_to_mask(tmp_path, monkeypatch):
    from concept_encoder.data.tokenizer import load_tokenizer

    monkeypatch.chdir(tmp_path)
    tokenizer = load_tokenizer("listops")
    for line in ("the quick brown fox jumps over the lazy dog", "the quick brown fox jumps over 3 lazy dogs"):
        problem = maskable_problem(tokenizer, [tokenizer(line)["input_ids"]] * 4)  # no digit, then one maskable
        assert problem.startswith("--tokenizer ") and "of the data's tokens as [UNK] and leaves" in problem
        assert "NaN loss" in problem and "\n" not in problem
    symbols = [tokenizer("[MAX 2 9 [MIN 4 7 ] 0 ]")["input_ids"]]
    assert maskable_problem(tokenizer, symbols) is None
    no_mask = SimpleNamespace(name_or_path="t", mask_token=None)
    assert "has no mask token" in maskable_problem(no_mask, symbols)
    assert "no tokens at all" in maskable_problem(tokenizer, [[tokenizer.pad_token_id]])


# --- the generated-task cache: malformed meta.json --------------------------------------------------------------


def damage(folder: Path, change) -> None:
    path = folder / "meta.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda meta: [meta], "holds a list, not the settings-and-digests mapping"),
        (lambda meta: "text", "holds a str"),
        (lambda meta: {k: v for k, v in meta.items() if k != "digests"}, "'digests' must map each of"),
        (lambda meta: {**meta, "digests": {"train": meta["digests"]["train"]}}, "'digests' must map each of"),
        (lambda meta: {**meta, "digests": list(meta["digests"].values())}, "'digests' must map each of"),
        (lambda meta: {**meta, "digests": {**meta["digests"], "dev": 7}}, "'digests' must map each of"),
        (lambda meta: {**meta, "train": 5}, "records other settings \\(train\\)"),
    ],
    ids=["list", "string", "no-digests", "partial", "digests-list", "wrong-type", "other-settings"],
)
def test_a_malformed_meta_json_is_named_and_the_entry_generated_again(tmp_path, caplog, change, named):
    first = listops_splits("listops:64:200", tmp_path)
    (folder,) = [p for p in (tmp_path / "tasks" / "listops").iterdir() if p.is_dir()]
    damage(folder, change)
    with pytest.raises(ValueError, match=f"{folder / 'meta.json'}.*{named}"):
        read_splits(folder, {"train": 200})
    with caplog.at_level(logging.WARNING):
        assert listops_splits("listops:64:200", tmp_path) == first  # generated again: the same splits
    assert any("is damaged" in r.getMessage() and "meta.json" in r.getMessage() for r in caplog.records)
    assert read_splits(folder) == first  # and the entry is whole again


def test_a_malformed_row_is_named_and_the_entry_generated_again(tmp_path):
    first = listops_splits("listops:64:200", tmp_path)
    (folder,) = [p for p in (tmp_path / "tasks" / "listops").iterdir() if p.is_dir()]
    (folder / "dev.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="dev.jsonl: every line must be a row with a text and a label"):
        read_splits(folder)
    assert listops_splits("listops:64:200", tmp_path) == first


# --- generator settings that could never finish -----------------------------------------------------------------


def test_the_longest_and_the_likeliest_tree_lengths_follow_the_rules():
    assert LONGEST_TREE == 1_222_222_222  # 10-argument operators down to depth 10
    p = length_distribution(64)
    assert math.isclose(p.sum(), 1.0) and p[1] == pytest.approx(0.75)  # a lone digit: no operator at the root
    assert (
        p[2] == pytest.approx(0, abs=1e-12)
        and p[3] == pytest.approx(0, abs=1e-12)
        and p[4] == pytest.approx(0.25 / 9 * 0.75**2)
    )  # one operator over two digits
    share, mean = window_share(500, 2000)
    assert 0.06 < share < 0.11 and 900 < mean < 1200  # LRA's bounds; the generator's own mean is about 1,050


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (ListOpsSettings(4, 6, 10_000, 50, 50), "10,100 distinct trees wanted but only 4,000 are longer than 4"),
        (ListOpsSettings(1, 4, 100, 50, 50), "no tree is longer than 1 and shorter than 4 symbols"),
        (ListOpsSettings(10, 11, 100, 50, 50), "no tree is longer than 10 and shorter than 11 symbols"),
        (ListOpsSettings(LONGEST_TREE, LONGEST_TREE + 9, 100, 50, 50), "a tree is 1 symbol \\(a digit\\) or 4 to"),
        (ListOpsSettings(5_000, 20_000, 1_000, 50, 50), f"beyond the generator's limit of {MAX_SYMBOLS:,}"),
    ],
    ids=["few-distinct", "below-the-shortest-operator", "empty-window", "beyond-the-longest", "too-rarely-drawn"],
)
def test_the_generator_refuses_bounds_it_could_never_fill_before_drawing(settings, message):
    start = time.monotonic()
    with pytest.raises(ValueError, match=message):
        generate_splits(settings)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("listops:20000", "take about 1.8e\\+09 draws of ~132 symbols, beyond the generator's limit"),
        ("listops:100000", "limit of 2,000,000,000 symbols; give fewer examples or a smaller max length"),
        ("listops:99999999999", "no tree is longer than 24999999999"),
        ("listops:500:300000000", "need [0-9,.]+ GiB of memory, this machine has .*: at most [0-9,]+ examples fit"),
        ("listops:16:900000000", "examples fit here; give fewer training examples"),
    ],
)
def test_listops_tasks_that_could_never_finish_are_refused_when_named(task, message):
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"task='{task}': .*{message}"):
        parse_listops(task)
    assert time.monotonic() - start < 5  # decided from the rules, not by generating


def test_the_tasks_in_use_are_still_accepted():
    for task in ("listops", "listops:16", "listops:500", "listops:2000:1000", "listops:4000"):
        parse_listops(task)


def test_the_shared_cache_refuses_sizes_beyond_its_limits_before_generating(tmp_path):
    def never():
        raise AssertionError("generated")

    for sizes in ({"train": 10**9, "dev": 0, "test": 0}, {"train": 10**15, "dev": 1, "test": 1}):
        with pytest.raises(ValueError, match="task='recall:8:64:16:huge': .*(limit of|GiB of memory)"):
            cached_splits("recall", "k", "recall:8:64:16:huge", sizes, never, tmp_path)
    assert "one in 10 draws kept" in generation_problem("w", MAX_SYMBOLS // 5, 1, 0.1)
    assert generation_problem("w", 1000) is None


def test_what_the_project_writes_is_json_without_nan_or_infinity():
    """`common.json_io.dumps`: every writer of results (summaries, metrics, reports, points) goes through it."""
    import json as plain_json

    from concept_encoder.common import json_io

    written = json_io.dumps({"loss": float("nan"), "rows": [1.5, float("inf"), (float("-inf"), 2)], "n": 3})
    assert "NaN" not in written and "Infinity" not in written
    assert plain_json.loads(written) == {"loss": None, "rows": [1.5, None, [None, 2]], "n": 3}
    with pytest.raises(ValueError):  # a non-finite number made by `default=` is refused, not written
        json_io.dumps({"x": object()}, default=lambda _: float("nan"))
    root = Path(__file__).resolve().parent.parent
    writers = ["loops/mlm.py", "loops/finetune.py", "concept_encoder/common/metrics_log.py",
               "concept_encoder/finetuning/report.py", "concept_encoder/decide/curve.py",
               "concept_encoder/decide/experiments.py"]  # fmt: skip
    for writer in writers:
        text = (root / writer).read_text()
        assert "json_io.dumps(" in text and ".write_text(json.dumps(" not in text, writer


# --- padding to a multiple: one round-up and one check for both loops ------------------------------------------


@pytest.mark.parametrize(("length", "multiple", "padded"), [(30, None, 30), (30, 0, 30), (30, 8, 32), (32, 8, 32), (1, 64, 64)])  # fmt: skip
def test_padded_length_rounds_up_to_the_multiple(length, multiple, padded):
    assert padded_length(length, multiple) == padded


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_padding_multiple_below_one_is_refused_by_both_loops_alike(value):
    message = rf"pad_to_multiple_of={value} must be >= 1 \(or unset\)"
    with pytest.raises(ValueError, match=message):
        training_args("--pad_to_multiple_of", value)
    with pytest.raises(ValueError, match=message):
        parse_args([*FINETUNE_MODEL, "--pad_to_multiple_of", value], FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("concept,gpt", "--architectures 'concept,gpt': ['gpt'] unknown; choose from ('concept', 'bert')"),
        ("bert,,bert", "--architectures 'bert,,bert': give distinct comma-separated values"),
        (" , ", "--architectures ' , ': give distinct comma-separated values"),
    ],
)
def test_a_drivers_axis_refuses_unknown_repeated_or_missing_choices(text, message):
    with pytest.raises(ValueError) as caught:
        parse_choices(text, "--architectures", ("concept", "bert"))
    assert str(caught.value) == message


def test_a_drivers_axis_keeps_the_order_given():
    assert parse_choices(" bert, concept", "--architectures", ("concept", "bert")) == ["bert", "concept"]


def test_jobs_split_the_cores_while_more_than_one_measures_and_give_them_back(monkeypatch, capsys):
    """On 2 cores: two cells to measure under --jobs 2 get one thread each, only while they run; one cell left to
    measure keeps the loops' own policy (all cores); three at once on 2 cores are said to share cores."""
    import os

    from concept_encoder.decide.experiments import check_jobs, measure_at_once
    from concept_encoder.training import runtime

    monkeypatch.setattr(runtime, "usable_cores", lambda: 2)
    monkeypatch.setenv("CPU_THREADS", "")  # recorded, so that whatever the test leaves is undone
    monkeypatch.delenv("CPU_THREADS")

    def threads():
        return os.environ.get("CPU_THREADS")

    two = SimpleNamespace(jobs=2, num_processes=1)
    assert measure_at_once([threads, threads], two, "cells", pending=2) == ["1", "1"]
    assert threads() is None and "--jobs 2: cells measured 2 at a time, 1 CPU thread(s) each" in capsys.readouterr().out
    assert measure_at_once([threads, threads], two, "cells", pending=1) == [None, None]  # the one left: all cores
    three = SimpleNamespace(jobs=3, num_processes=1)
    assert measure_at_once([threads] * 3, three, "cells", pending=3) == ["1"] * 3
    assert "warning: --jobs 3: 3 launches x 1 thread(s) on 2 cores" in capsys.readouterr().err
    monkeypatch.setenv("CPU_THREADS", "2")  # the user's: kept
    assert measure_at_once([threads, threads], two, "cells", pending=2) == ["2", "2"] and threads() == "2"
    with pytest.raises(ValueError, match="--jobs 2 with --num_processes 2: launches side by side would share one"):
        check_jobs(SimpleNamespace(jobs=2, num_processes=2))
    check_jobs(SimpleNamespace(jobs=1, num_processes=2))
