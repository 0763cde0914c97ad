"""DeepSpeed on CPU (gloo): every ZeRO config trains like ZeRO-0 (ZeRO-3 building the model partitioned, with
the same initial weights), a ZeRO-0/2 run resumes on one process, ZeRO-3 resumes exactly and exports a plain HF
model, and the simulated multi-node launch matches single-node (zero_compare's report is checked by the GPU check's
dry run, tests/test_benchmarks.py, whose zero part it is).

Every launch is a real `accelerate launch` with 2 processes on the tiny `micro` preset, with a timeout. The six
comparison runs (one per ds config), the ZeRO-3 run from a saved model and the ZeRO-3 distillation are made by one
launch, one run after another in the same two ranks (`made`, `tests/one_launch_several_runs.py`: the ranks start
and import once, not eight times); the ZeRO-3 comparison run is also the one the resume, export, partitioned-load
and multi-node tests start from. The resumes and the two-node run are launches of their own: a fresh process is
what they check.
"""

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from concept_encoder import ConceptEncoderForMaskedLM
from concept_encoder.checkpoints.checkpoint import CheckpointError, deepspeed_safe_globals
from concept_encoder.common import process_group
from concept_encoder.training.resume import check_resume_settings

ROOT = Path(__file__).resolve().parents[1]
LOOP = [
    str(ROOT / "loops" / "mlm.py"), "--preset", "micro", "--max_seq_length", "64",
    "--tokenizer", "train:wordpiece:2000", "--report_to", "none", "--progress_bar", "false",
    "--per_device_train_batch_size", "8", "--logging_steps", "1", "--eval_steps", "0", "--save_steps", "0",
    "--max_eval_batches", "2", "--output_dir", "runs",
]  # fmt: skip
TIMEOUT = 300
pytestmark = pytest.mark.alone  # two ranks per launch: on 2 cores they need the machine to themselves
_ports = itertools.count(29800)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("deepspeed")


def launch(
    workdir: Path,
    ds_config: str,
    *loop_args: str,
    machine: tuple[int, int] | None = None,
    processes: int = 2,
    script: list[str] | None = None,
):
    """`accelerate launch` of the loop under `ds_configs/<ds_config>.json` on `processes` processes;
    `machine=(rank, port)` makes it one of two single-process nodes of a simulated 2-machine run (its output goes to
    `<workdir>/node<rank>.log`, not a pipe: the test waits for one node at a time, and a node blocked on a full pipe
    nobody reads would hold the other in its collectives until the timeout); `script` (a script and its first
    arguments) is launched instead of the loop, with the loop's flags."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if machine is None:
        cmd += ["--config_file", str(ROOT / "launch/cpu.yaml"), "--main_process_port", str(next(_ports))]
        cmd += ["--num_processes", str(processes)]
    else:
        rank, port = machine
        cmd += ["--config_file", str(ROOT / "launch/multi_node.yaml"), "--num_processes", "2"]
        cmd += ["--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1"]
        cmd += ["--main_process_port", str(port)]
    cmd += ["--deepspeed_config_file", str(ROOT / "ds_configs" / f"{ds_config}.json")]
    cmd += [*(script or [LOOP[0]]), *LOOP[1:], *loop_args]
    if machine is None:
        return process_group.start(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = workdir / f"node{machine[0]}.log"
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # a rank killed by a signal leaves every thread's stack in the log
    with log.open("w") as out:
        process = process_group.start(cmd, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    process.log = log
    return process


def finish(process) -> str:
    """Wait for a launch; on timeout its whole process group (launcher and ranks) is ended."""
    try:
        code, out, _ = process_group.finish(process, TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"launch timed out after {TIMEOUT}s")
    out = out if out is not None else process.log.read_text()  # a node's output is in its log file
    assert code == 0, out[-4000:]
    return out


def losses(workdir: Path, run: str) -> list[float]:
    records = [json.loads(x) for x in (workdir / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


COMPARED = ("zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload")
COMPARISON = ["--max_steps", "4", "--save_steps", "2"]  # checkpoints at steps 2 and 4, a final model
ONE_LAUNCH = {  # run name: (ds config, its own flags, the runs it starts from); made in this order
    **{config: (config, COMPARISON, ()) for config in COMPARED},
    "z3loaded": ("zero3", ["--max_steps", "1", "--model_name_or_path", "runs/zero3/final", "--tokenizer",
                           "runs/zero3/final", "--preset", "small"], ("zero3",)),
    # a model folder is read with its own tokenizer and has its own shape ("small" is the default: no preset)
    "z3distil": ("zero3", ["--max_steps", "4", "--objective", "distill", "--packing", "false", "--teacher",
                           "teacher", "--learning_rate", "3e-3"], ()),
    "z3bf16": ("zero3", ["--max_steps", "2", "--save_steps", "2", "--mixed_precision", "bf16"], ()),
}  # fmt: skip


def made(workdir: Path, *names: str) -> list[Path]:
    """The run folders of `names` (`ONE_LAUNCH`), the ones not made yet (and the runs they start from) made by
    one launch of `tests/one_launch_several_runs.py`: the ZeRO comparison asks for all of them at once, and the
    resharding, resume, export, multi-node, partitioned-load and distillation tests read theirs (each makes its
    own when it runs alone)."""
    wanted = set(names) | {start for name in names for start in ONE_LAUNCH[name][2]}
    missing = [
        name for name in ONE_LAUNCH if name in wanted and not (workdir / "runs" / name / "summary.json").exists()
    ]
    if "z3distil" in missing and not (workdir / "teacher").exists():
        from loop_runs import tiny_teacher

        tiny_teacher(workdir / "teacher")
    if missing:
        runs = json.dumps([[name, *ONE_LAUNCH[name][:2]] for name in missing])
        script = [str(ROOT / "tests" / "one_launch_several_runs.py"), runs]
        finish(launch(workdir, ONE_LAUNCH[missing[0]][0], script=script))
    return [workdir / "runs" / name for name in names]


@pytest.fixture(scope="module")
def zero0_losses(workdir):
    made(workdir, *ONE_LAUNCH)
    config = json.loads((workdir / "runs/zero0/config.json").read_text())
    assert config["system"]["world_size"] == 2 and "DEEPSPEED" in config["system"]["distributed_type"]
    return losses(workdir, "zero0")


@pytest.mark.loop
@pytest.mark.parametrize("ds_config", ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"])
def test_zero_config_matches_zero0(workdir, zero0_losses, ds_config):
    made(workdir, ds_config)
    got = losses(workdir, ds_config)
    # DeepSpeed's CPU Adam (offload) rounds differently from torch's AdamW, and the default recipe's concept
    # losses carry the difference on: agreement to ~1e-3 relative after 4 steps (the others are bitwise equal)
    assert got == pytest.approx(zero0_losses, rel=2e-3), f"{ds_config}: {got} vs zero0 {zero0_losses}"
    ranks = [json.loads((workdir / f"runs/{ds_config}/ranks/rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    held = [rank["held_at_construction"] for rank in ranks]
    if ds_config.startswith("zero3"):  # built under deepspeed.zero.Init: each rank only ever held its shard
        total = held[0]["total"]
        assert all(h["local"] <= total / 2 + 100 for h in held) and sum(h["local"] for h in held) >= total
    else:
        assert all(h["local"] == h["total"] for h in held)


def tree_of(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.loop
@pytest.mark.parametrize("ds_config", ["zero0", "zero2"])
def test_a_two_process_zero0_or_zero2_run_resumes_on_one_process(workdir, ds_config):
    checkpoint = made(workdir, ds_config)[0] / "checkpoints/step_0000002"
    before, name = tree_of(checkpoint), f"{ds_config}-one"
    out = finish(launch(workdir, ds_config, "--run_name", name, "--max_steps", "4", "--gradient_accumulation_steps",
                        "2", "--save_steps", "2", "--resume_from_checkpoint", str(checkpoint), processes=1))  # fmt: skip
    # ZeRO-2's optimizer shards go through a universal checkpoint; fp32 ZeRO-0's whole optimizer state loads as is
    assert ("DeepSpeed universal checkpoint" in out) == (ds_config == "zero2"), out[-3000:]
    assert tree_of(checkpoint) == before and not (workdir / f"runs/{name}/resharding").exists()  # staged aside, removed
    two = [json.loads(x) for x in (workdir / f"runs/{ds_config}/metrics.jsonl").read_text().splitlines()]
    one = [json.loads(x) for x in (workdir / f"runs/{name}/metrics.jsonl").read_text().splitlines()]
    two, one = ([r for r in records if r["kind"] == "train"] for records in (two, one))
    assert [r["step"] for r in one] == [3, 4] and [r["tokens_seen"] for r in one] == [r["tokens_seen"] for r in two[2:]]
    # the same micro-batches each step, rank 1's masks now drawn by rank 0's generator: the two-process curve to
    # within the masking's noise
    assert [r["loss"] for r in one] == pytest.approx([r["loss"] for r in two[2:]], rel=0.02)
    settings = json.loads((workdir / f"runs/{name}/checkpoints/step_0000004/resume_settings.json").read_text())
    assert (settings["world_size"], settings["gradient_accumulation_steps"]) == (1, 2)
    # Adam's state went on from step 2 (moments dropped at the resume would count 2 steps, and their second
    # moment would hold half the squared gradients): step 4's state against the two-process run's
    one, two = adam_state(workdir / f"runs/{name}", 4, ranks=1), adam_state(workdir / f"runs/{ds_config}", 4, ranks=2)
    assert one["step"] == two["step"] == 4
    assert one["exp_avg_sq"].shape == two["exp_avg_sq"].shape
    assert one["exp_avg_sq"].norm() == pytest.approx(two["exp_avg_sq"].norm().item(), rel=0.1)


def adam_state(run_dir: Path, step: int, ranks: int) -> dict:
    """A DeepSpeed checkpoint's Adam state of its first parameter group: `step` and the second moment, flat
    (ZeRO-1/2: the ranks' partitions joined; fp32 ZeRO-0: the first parameter's, whole in the model states)."""
    folder = run_dir / f"checkpoints/step_{step:07d}/pytorch_model"
    shards = [folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in range(ranks)]
    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        if not shards[0].exists():
            state = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=True)["optimizer"]["state"][0]
            return {"step": float(state["step"]), "exp_avg_sq": state["exp_avg_sq"].flatten()}
        states = [torch.load(shard, weights_only=True)["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
                  for shard in shards]  # fmt: skip
    return {"step": states[0]["step"].item(), "exp_avg_sq": torch.cat([state["exp_avg_sq"] for state in states])}


@pytest.mark.loop
def test_zero3_resume_is_exact_and_export_is_a_plain_hf_model(workdir):
    full_run = made(workdir, "zero3")[0]
    full = losses(workdir, "zero3")
    checkpoint = full_run / "checkpoints/step_0000002"
    assert any(checkpoint.rglob("*optim_states.pt")), "ZeRO-3 writes per-rank optimizer shards"
    settings = {**json.loads((checkpoint / "resume_settings.json").read_text()), "world_size": 1}
    with pytest.raises(CheckpointError, match=r"world_size: checkpoint 2, this run 1 \(a ZeRO-3 checkpoint: its weights "
                       r"are partitioned over 2 ranks; resume it with 2 processes, or export its weights"):  # fmt: skip
        check_resume_settings(checkpoint, settings)  # refused before anything is loaded

    resumed_dir = workdir / "runs/z3resumed/checkpoints"
    resumed_dir.mkdir(parents=True)
    shutil.copytree(checkpoint, resumed_dir / checkpoint.name)
    resumed = str(resumed_dir / checkpoint.name)
    finish(launch(workdir, "zero3", "--max_steps", "4", "--save_steps", "2", "--resume_from_checkpoint", resumed))
    assert losses(workdir, "z3resumed") == full[2:]

    summary = json.loads((full_run / "summary.json").read_text())
    assert summary["export_max_abs_diff"] is not None and summary["export_max_abs_diff"] < 1e-5
    plain = ConceptEncoderForMaskedLM.from_pretrained(full_run / "final").eval()
    resumed = ConceptEncoderForMaskedLM.from_pretrained(workdir / "runs/z3resumed/final").eval()
    ids = torch.randint(5, 2000, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, resumed(ids).logits)


@pytest.mark.loop
def test_zero3_continues_from_a_saved_model_loaded_partitioned(workdir):
    """`--model_name_or_path` under ZeRO-3: transformers loads the saved weights straight into partitions."""
    made(workdir, "z3loaded")
    final = workdir / "runs/zero3/final"
    held = [
        json.loads((workdir / f"runs/z3loaded/ranks/rank{r}.json").read_text())["held_at_construction"] for r in (0, 1)
    ]
    assert all(h["local"] <= h["total"] / 2 + 100 for h in held)
    plain = ConceptEncoderForMaskedLM.from_pretrained(final)
    assert held[0]["total"] == sum(p.numel() for p in {id(p): p for p in plain.parameters()}.values())
    summary = json.loads((workdir / "runs/z3loaded/summary.json").read_text())
    assert summary["export_max_abs_diff"] < 1e-5
    first_loss = losses(workdir, "z3loaded")[0]
    assert first_loss < losses(workdir, "zero3")[0] - 0.01  # it starts from the trained weights, not fresh ones


@pytest.mark.loop
def test_export_gathers_a_zero3_checkpoint_into_the_final_model(workdir, tmp_path):
    """`python -m concept_encoder export` of the last ZeRO-3 checkpoint (two ranks' shards, fp32 master weights
    gathered by DeepSpeed's zero_to_fp32) computes what the run's final model computes."""
    from concept_encoder.checkpoints import export

    run = made(workdir, "zero3")[0]
    checkpoint = run / "checkpoints/step_0000004"
    assert sorted(p.name for p in (checkpoint / "pytorch_model").glob("*_model_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
    ]  # fmt: skip
    out = tmp_path / "exported"
    assert export.main([str(checkpoint), str(out)]) == 0
    record = json.loads((out / "export.json").read_text())
    assert record["step"] == 4 and "zero_to_fp32" in record["weights_from"]
    assert record["check"]["max_abs_logit_diff"] <= 1e-5
    exported = ConceptEncoderForMaskedLM.from_pretrained(out).eval()
    final = ConceptEncoderForMaskedLM.from_pretrained(run / "final").eval()
    ids = torch.randint(5, 2000, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, final(ids).logits)


@pytest.mark.loop
def test_a_bf16_zero2_run_saves_its_fp32_masters_and_fine_tuning_loads_float32(workdir, tmp_path):
    """DeepSpeed's bf16 casts the module to bf16 and keeps the fp32 weights in its optimizer: `final/` holds those
    masters in float32 (what an export of the same step reads from the checkpoint, bit for bit), config.json says
    float32, the end-of-run check ran the reload as the run ran (bf16) and agrees, and the classifier a fine-tuning
    run builds on it, and its from-scratch twin, are float32."""
    from concept_encoder.checkpoints import export
    from concept_encoder.training.model import build_classifier

    finish(launch(workdir, "zero2", "--run_name", "z2bf16", "--mixed_precision", "bf16", "--max_steps", "2",
                  "--save_steps", "2", processes=1))  # fmt: skip
    run = workdir / "runs/z2bf16"
    final = run / "final"
    weights = load_file(final / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.float32}
    assert json.loads((final / "config.json").read_text())["dtype"] == "float32"
    check = json.loads((run / "summary.json").read_text())["export_check"]
    assert check["dtype"] == "bfloat16" and check["alike"] and check["passed"] and check["max_abs_diff"] < 1e-4
    export.export(run / "checkpoints/step_0000002", tmp_path / "exported")
    exported = load_file(tmp_path / "exported/model.safetensors")
    assert exported.keys() == weights.keys() and all(torch.equal(exported[k], weights[k]) for k in weights)
    assert any(not torch.equal(w, w.bfloat16().float()) for w in weights.values())  # masters, not bf16 copies
    task = type("Task", (), {"num_labels": 2, "task_type": "single_label_classification", "label_names": None})()
    for from_scratch in (False, True):
        classifier, _ = build_classifier(str(final), task, from_scratch)
        assert {p.dtype for p in classifier.parameters()} == {torch.float32}


@pytest.mark.loop
def test_a_bf16_zero3_run_gathers_its_fp32_masters_from_both_ranks_into_final(workdir, tmp_path):
    """Under ZeRO-3 each rank holds a shard of the fp32 masters: `final/` gathers them (DeepSpeed's
    `safe_get_full_fp32_param` on every rank), and equals what `export` gathers from the checkpoint's shards."""
    from concept_encoder.checkpoints import export

    run = made(workdir, "z3bf16")[0]
    weights = load_file(run / "final/model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.float32}
    check = json.loads((run / "summary.json").read_text())["export_check"]
    assert check["dtype"] == "bfloat16" and check["alike"] and check["passed"]
    export.export(run / "checkpoints/step_0000002", tmp_path / "exported")
    exported = load_file(tmp_path / "exported/model.safetensors")
    assert exported.keys() == weights.keys() and all(torch.equal(exported[k], weights[k]) for k in weights)
    assert any(not torch.equal(w, w.bfloat16().float()) for w in weights.values())  # masters, not bf16 copies


@pytest.mark.loop
def test_simulated_two_node_zero3_matches_single_node(workdir):
    made(workdir, "zero3")  # the single-node run
    port = next(_ports)
    nodes = [launch(workdir, "zero3", "--run_name", "z3nodes", "--max_steps", "4", machine=(r, port)) for r in (0, 1)]
    for node in nodes:
        finish(node)
    config = json.loads((workdir / "runs/z3nodes/config.json").read_text())
    assert config["system"]["world_size"] == 2
    ranks = [json.loads((workdir / f"runs/z3nodes/ranks/rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["eval_loss"] == ranks[1]["eval_loss"]
    assert losses(workdir, "z3nodes") == pytest.approx(losses(workdir, "zero3"), rel=1e-5)


@pytest.mark.loop
def test_distillation_under_zero3_trains_the_sharded_student_and_the_ranks_agree(workdir):
    """The teacher's targets are computed before the engine exists; the projection is the objective's own."""
    made(workdir, "z3distil")
    records = [json.loads(x) for x in (workdir / "runs/z3distil/metrics.jsonl").read_text().splitlines()]
    distilled = [r["distill/cosine"] for r in records if r["kind"] == "train"]
    assert len(distilled) == 4 and distilled[-1] < distilled[0]
    ranks = [json.loads((workdir / f"runs/z3distil/ranks/rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["eval_loss"] == ranks[1]["eval_loss"]


def test_zero3_construction_config_resolves_autos_as_accelerate_does(monkeypatch):
    from types import SimpleNamespace

    from concept_encoder.training.deepspeed_setup import zero3_construction_config

    args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=8, mixed_precision=None)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", raising=False)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ROOT / "ds_configs/zero3_offload.json"))
    config = zero3_construction_config(args, world_size=2)
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (4, 8)
    assert config["train_batch_size"] == 64 and "gradient_clipping" not in config
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false")  # `accelerate launch --zero3_init_flag false`
    assert zero3_construction_config(args, world_size=2) is None
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO3_INIT")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ROOT / "ds_configs/zero2_offload.json"))
    assert zero3_construction_config(args, world_size=2) is None  # not stage 3: built whole, as before
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")  # `--zero_stage 3 --offload_param_device cpu`
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "cpu")
    flags = zero3_construction_config(args, world_size=1)
    assert flags["zero_optimization"]["stage"] == 3 and flags["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_make_install_builds_the_deepspeed_ops_a_run_would_compile_first(capsys):
    """`launch/build_ops.py` (run by `make install`) leaves CPU Adam and the CPU collectives built: a load
    afterwards finds them (seconds, not the minute and a half of a build)."""
    import launch.build_ops as build_ops
    from concept_encoder.machine.extension_locks import extensions_root

    assert build_ops.main([]) == 0
    out = capsys.readouterr().out
    assert "DeepSpeed op cpu_adam: ready" in out and "DeepSpeed op deepspeed_shm_comm: ready" in out
    assert list(extensions_root().glob("**/cpu_adam/cpu_adam.so")) and list(extensions_root().glob("**/*shm_comm.so"))
