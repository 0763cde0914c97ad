"""The package's shape: a torch-free core, lazy public names, Auto registration, one-way imports."""

import ast
import importlib
import importlib.metadata
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import concept_encoder
import concept_encoder.data
import concept_encoder.tasks

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, cwd=ROOT) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


# Modules the plan checker, argument parsing, preflight and the run readers import before (or without) torch.
TORCH_FREE = [
    "concept_encoder.constants",
    "concept_encoder.model.constants",
    "concept_encoder.model.presets",
    "concept_encoder.accounting.memory",
    "concept_encoder.accounting.flops",
    "concept_encoder.common.paths",
    "concept_encoder.common.report_files",
    "concept_encoder.common.entry",
    "concept_encoder.common.cli_types",
    "concept_encoder.common.process_group",
    "concept_encoder.data.base",
    "concept_encoder.data.stdlib_sentences",
    "concept_encoder.training.args",
    "concept_encoder.training.plan",
    "concept_encoder.training.gates",
    "concept_encoder.common.faults",
    "concept_encoder.common.metrics_log",
    "concept_encoder.machine.extension_locks",
    "concept_encoder.machine.checks",
    "concept_encoder.training.preflight",
    "concept_encoder.decide.compare",
]


def test_the_torch_free_modules_import_without_torch():
    out = run_python(
        "import sys\n"
        f"import {', '.join(TORCH_FREE)}\n"
        "from concept_encoder.training.args import parse_args\n"
        "model, data, train = parse_args(['--preset', 'tiny', '--masking', 'span'])\n"
        "print('LOADED', sorted(m for m in ('torch', 'datasets', 'accelerate', 'transformers.modeling_utils') "
        "if m in sys.modules), model.preset, data.masking)\n"
    )
    assert "LOADED [] tiny span" in out


@pytest.mark.parametrize(
    "imports",
    [
        "import concept_encoder\nfrom transformers import AutoConfig, AutoModelForMaskedLM",
        "from transformers import AutoConfig, AutoModelForMaskedLM\nimport concept_encoder",
        "from concept_encoder import ConceptEncoderForMaskedLM\nfrom transformers import AutoConfig, AutoModelForMaskedLM",
        # the encoder's module loads transformers' Auto mappings while it executes: the heads register after it
        "from concept_encoder import ConceptEncoder\nfrom transformers import AutoConfig, AutoModelForMaskedLM",
        "import concept_encoder.model.bert_baseline\nfrom transformers import AutoConfig, AutoModelForMaskedLM",
    ],
    ids=["package-first", "transformers-first", "class-import", "encoder-first", "bert-twin-first"],
)
def test_auto_classes_load_a_saved_model_in_any_import_order(imports, tmp_path):
    from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset

    ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=64)).save_pretrained(tmp_path / "model")
    out = run_python(
        f"{imports}\n"
        f"config = AutoConfig.from_pretrained({str(tmp_path / 'model')!r})\n"
        f"model = AutoModelForMaskedLM.from_pretrained({str(tmp_path / 'model')!r})\n"
        "print('LOADED', type(config).__name__, type(model).__name__)\n"
    )
    assert "LOADED ConceptEncoderConfig ConceptEncoderForMaskedLM" in out


@pytest.mark.parametrize(
    "package", [concept_encoder, concept_encoder.data, concept_encoder.tasks], ids=lambda p: p.__name__
)
def test_every_lazy_name_resolves_and_none_is_shadowed_by_a_submodule(package):
    submodules = {m.name for m in pkgutil.iter_modules(package.__path__)}
    assert not submodules & set(package.EXPORTS), "importing that submodule would replace the name with the module"
    for name, module in package.EXPORTS.items():
        assert getattr(package, name) is getattr(importlib.import_module(f"{package.__name__}.{module}"), name)
    assert set(package.EXPORTS) <= set(dir(package))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        package.nope  # noqa: B018


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_module_outside_loops_imports_a_loop():
    python_files = [p for folder in ("concept_encoder", "launch", "benchmarks") for p in (ROOT / folder).rglob("*.py")]
    assert len(python_files) > 30
    offenders = {
        str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if m == "loops" or m.startswith("loops."))
        for p in python_files
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}
    library = [p for p in (ROOT / "concept_encoder").rglob("*.py")]
    assert not {
        str(p.relative_to(ROOT))
        for p in library
        if any(m.split(".")[0] in ("launch", "benchmarks") for m in imported_modules(p))
    }, "the library imports no tool"


LIBRARY = ROOT / "concept_encoder"
# folders that know nothing of the ones above them (checkpoint files and the machine's facts sit below the loop)
LOWER = ("model", "concepts", "accounting", "common", "data", "machine", "checkpoints")
UPPER = ("training", "decide", "tasks", "finetuning")


def library_imports(path: Path) -> set[str]:
    """Every `concept_encoder...` module `path` imports, relative imports resolved, in functions too."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            names |= {target} if node.module else {f"{target}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("concept_encoder"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("concept_encoder")}
    return names


def test_imports_run_one_way_lower_folders_never_import_training_decide_or_tasks():
    offenders = {}
    for folder in LOWER:
        for path in sorted((LIBRARY / folder).rglob("*.py")):
            upward = sorted(
                name for name in library_imports(path) if name.split(".")[1:2] and name.split(".")[1] in UPPER
            )
            if upward:
                offenders[str(path.relative_to(ROOT))] = upward
    assert offenders == {}
    assert len([p for folder in LOWER for p in (LIBRARY / folder).rglob("*.py")]) > 30
    readers_of_decide = {
        str(p.relative_to(ROOT))
        for p in LIBRARY.rglob("*.py")
        if "decide" not in p.parts and any(n.startswith("concept_encoder.decide") for n in library_imports(p))
    }
    assert readers_of_decide == set(), "the tools sit on top: nothing in the library imports decide/"


def test_the_files_a_saved_model_carries_import_only_each_other():
    """transformers copies a model's module and its single-dot imports beside the weights; any other import of
    the library would make `trust_remote_code` need this package, or break `save_pretrained`."""
    from transformers.dynamic_module_utils import get_relative_import_files

    carried = {Path(p).name for p in get_relative_import_files(str(LIBRARY / "model" / "heads.py"))}
    assert {"config.py", "constants.py", "modeling.py", "attention.py", "vocab_projection.py"} <= carried
    for name in carried | {"heads.py"}:
        tree = ast.parse((LIBRARY / "model" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level in (0, 1), f"model/{name}: `from {'.' * node.level}{node.module}` leaves model/"
                assert node.level == 1 or not (node.module or "").startswith("concept_encoder"), f"model/{name}"


def test_every_folder_states_its_concern_and_the_top_level_is_only_the_face():
    folders = sorted(p.parent for p in LIBRARY.glob("*/__init__.py"))
    assert {f.name for f in folders} == {*LOWER, *UPPER}
    for folder in folders:
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 12, f"{folder.name}/__init__.py: say in its docstring what the folder is for"
    assert sorted(p.name for p in LIBRARY.glob("*.py")) == ["__init__.py", "__main__.py", "constants.py"]


def test_no_folder_holds_more_than_a_quarter_of_the_library_and_training_holds_only_the_loop_steps():
    """One concern per room (issue 56): a folder that grows past a quarter of the library's lines, or `training/`
    past 20 modules, holds more than the loop's steps and wants splitting again."""
    lines = {folder.name: sum(len(p.read_text().splitlines()) for p in folder.rglob("*.py"))
             for folder in sorted(p.parent for p in LIBRARY.glob("*/__init__.py"))}  # fmt: skip
    total = sum(len(p.read_text().splitlines()) for p in LIBRARY.rglob("*.py"))
    assert {name: n for name, n in lines.items() if n > total / 4} == {}
    assert len(list((LIBRARY / "training").glob("*.py"))) <= 20


# A model folder (code files, config, weights, expected logits) as an archive: old code, frozen, not linted.
FIXTURE = ROOT / "tests" / "fixtures" / "saved_before_subpackages.tar.gz"


def test_a_model_saved_before_the_subpackage_move_loads_and_computes_the_same(tmp_path):
    """The fixture was written by the flat-layout package (all modules at the top, commit 1f2a0ae), with its
    logits on fixed ids. It must load through this package's Auto registration and through its own copied
    code (`trust_remote_code`, without this package), and both must compute what it computed then."""
    import json
    import tarfile

    import torch
    from loop_runs import load_without_the_package
    from transformers import AutoModelForMaskedLM

    from concept_encoder import ConceptEncoderForMaskedLM

    with tarfile.open(FIXTURE) as archive:
        archive.extractall(tmp_path / "saved", filter="data")
    folder = tmp_path / "saved" / "saved_before_subpackages"
    expected = json.loads((folder / "expected.json").read_text())
    model = AutoModelForMaskedLM.from_pretrained(folder).eval()
    assert type(model) is ConceptEncoderForMaskedLM
    ids = torch.tensor(expected["input_ids"])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
        local_sum = float(model(input_ids=torch.arange(5, 21)[None]).logits.double().sum())
    torch.testing.assert_close(logits, torch.tensor(expected["logits"]), atol=2e-5, rtol=0)
    name, module, remote_sum = load_without_the_package(folder, tmp_path, trust_remote_code=True)
    assert (name, module.split(".")[0]) == ("ConceptEncoderForMaskedLM", "transformers_modules")
    assert remote_sum == pytest.approx(local_sum, rel=1e-6, abs=1e-6)


def run_tool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "concept_encoder", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_one_way_in_lists_the_tools_runs_each_by_name_and_refuses_an_unknown_one(capsys):
    """`python -m concept_encoder` as a command (the listing, a tool's usage line); its `main(argv)` in this
    process for what the dispatcher itself decides (the same function `-m` runs: a process saved per call)."""
    from concept_encoder.__main__ import TOOLS, main

    def dispatched(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err

    listing = run_tool("--help")
    assert listing.returncode == 0 and all(name in listing.stdout for name in TOOLS)
    for name, (module, _) in TOOLS.items():
        assert callable(importlib.import_module(module).main), f"{name}: {module} has no main(argv)"
    code, presets, _ = dispatched("presets", "--vocab_size", "1000")
    assert code == 0 and "vocab_size=1000" in presets
    assert dispatched("--vocab_size", "1000")[1] == presets  # the bare form prints the presets, as before
    helped = run_tool("compare", "--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: python -m concept_encoder compare")
    scripts = importlib.metadata.entry_points(group="console_scripts", name="concept-encoder")
    assert [s.value for s in scripts] == ["concept_encoder.__main__:main"], "pyproject.toml [project.scripts]"
    code, _, err = dispatched("comapre")
    assert code == 2 and "unknown tool 'comapre'" in err and "compare" in err


def test_the_project_root_is_the_checkout_wherever_the_paths_module_sits():
    from concept_encoder.common.paths import PROJECT_ROOT

    assert PROJECT_ROOT == ROOT
    assert (PROJECT_ROOT / "loops" / "mlm.py").is_file() and (PROJECT_ROOT / "pyproject.toml").is_file()


def test_ctrl_c_in_a_tool_is_one_line_and_exit_code_130(monkeypatch, capsys):
    from concept_encoder import __main__ as one_way_in
    from concept_encoder.decide import compare

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "main", interrupted)
    assert one_way_in.main(["compare", "Cache/runs/a"]) == 130
    assert capsys.readouterr().err.strip() == (
        "python -m concept_encoder compare: interrupted (what finished is kept: rerun the same command to continue)"
    )


def main_blocks() -> dict[str, str]:
    """Every file of the package, the loops and the launch scripts that runs as a program → its `__main__` block."""
    blocks = {}
    for path in sorted([*ROOT.glob("concept_encoder/**/*.py"), *ROOT.glob("loops/*.py"), *ROOT.glob("launch/*.py")]):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
                blocks[str(path.relative_to(ROOT))] = blocks.get(str(path.relative_to(ROOT)), "") + ast.unparse(node)
    return blocks


def test_every_program_ends_a_ctrl_c_in_one_line_however_it_is_started():
    blocks = main_blocks()
    assert len(blocks) >= 12 and "concept_encoder/decide/curve.py" in blocks and "loops/mlm.py" in blocks

    def guarded(path: str, block: str) -> bool:  # the block calls run_tool, or its main() does (the dispatcher)
        tree = ast.parse((ROOT / path).read_text())
        mains = [ast.unparse(f) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "main"]
        return "run_tool(" in block or "main()" in block and any("run_tool(" in m for m in mains)

    missing = [path for path, block in blocks.items() if not guarded(path, block)]
    assert missing == [], f"these __main__ blocks let Ctrl-C print a traceback (use common.entry.run_tool): {missing}"
    early = [path for path in ("loops/mlm.py", "loops/finetune.py") if "interrupt_in_one_line(" not in blocks[path]]
    assert early == [], f"Ctrl-C while these loops import torch prints a traceback: {early}"


def as_from_a_terminal() -> None:
    """`Popen`'s `preexec_fn` for the Ctrl-C tests: SIGINT as a terminal's Ctrl-C finds it. A suite started in the
    background without job control (`make test &` in a script, `nohup ... &`) runs with SIGINT ignored, which
    every child inherits, and Python then installs no KeyboardInterrupt handler: the signal under test would be
    dropped and the test fail for its environment, not for the code."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.alone
def test_ctrl_c_while_a_module_path_imports_is_one_line():
    import signal
    import time

    process = subprocess.Popen([sys.executable, "-m", "concept_encoder.decide.check_health", "--help"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=as_from_a_terminal)  # fmt: skip
    time.sleep(1.0)  # inside the imports: torch and transformers alone take seconds
    assert process.poll() is None, "the module imported in under a second: this test no longer reaches its imports"
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert "Traceback" not in err and err.strip().endswith(
        "python -m concept_encoder: interrupted (what finished is kept: rerun the same command to continue)"
    )
    assert process.returncode in (130, -signal.SIGINT)  # the interpreter's own SIGINT exit after the hook


FAKE_LAUNCH = """
import signal, subprocess, sys, time
if sys.argv[1] == "launcher":  # like torch's launcher: a signal here, or a rank that fails, ends in a traceback
    rank = subprocess.Popen([sys.executable, __file__, "rank", sys.argv[2]])
    if rank.wait() != 0:
        raise RuntimeError("ChildFailedError: a rank ended by the interrupt")
    sys.exit(0)
def stop(*_):
    print("rank: checkpoint saved", flush=True)
    if sys.argv[2] == "before-training":  # a loop interrupted while it prepares: one line, exit code 130
        print("loops/mlm.py: interrupted (what finished is kept: rerun the same command to continue)", file=sys.stderr)
        sys.exit(130)
    sys.exit(130)  # like the loops: checkpointed, not finished (the launcher then fails: not relayed)
signal.signal(signal.SIGINT, stop)
print("rank: training", flush=True)
time.sleep(60)
"""


@pytest.mark.alone
@pytest.mark.parametrize(
    ("when", "stop", "exit_code"),
    [("training", "SIGINT", 130), ("before-training", "SIGINT", 130), ("training", "SIGTERM", 143)],
)
def test_ctrl_c_in_a_tool_stops_the_launched_ranks_at_a_checkpoint_not_the_launcher(tmp_path, when, stop, exit_code):
    """What curve, ablate and check_plan --run do with `accelerate launch`: the interrupt goes to the ranks (they
    checkpoint and exit), the launcher ends with them, its report of ranks stopped before training (a traceback
    under torch's multi-process launcher) is not relayed, the loop's one line is, and the tool says one line.
    SIGTERM to the tool (`kill`, `timeout`) does the same, exit code 143: by default it would end the tool alone
    and leave the launch, in a session of its own, training on."""
    import signal
    import time

    launch = tmp_path / "launch.py"
    launch.write_text(FAKE_LAUNCH)
    tool = ("import sys\nfrom concept_encoder.common.entry import run_tool\nfrom concept_encoder.common.process_group "
            "import call_interrupting_ranks\n"
            f"sys.exit(run_tool(lambda a: call_interrupting_ranks([sys.executable, {str(launch)!r}, 'launcher', "
            f"{when!r}]), 'tool'))")  # fmt: skip
    process = subprocess.Popen([sys.executable, "-c", tool], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_terminal)  # fmt: skip
    assert process.stdout.readline().strip() == "rank: training"
    time.sleep(0.2)
    process.send_signal(getattr(signal, stop))  # the terminal's Ctrl-C reaches the tool's process group only
    out, err = process.communicate(timeout=60)
    assert "rank: checkpoint saved" in out and "Traceback" not in err and "ChildFailedError" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1] == "tool: interrupted (what finished is kept: rerun the same command to continue)"
    assert lines[:-1] == (["loops/mlm.py: interrupted (what finished is kept: rerun the same command to continue)"]
                          if when == "before-training" else [])  # the loop's own line passes, the launcher's not  # fmt: skip
    assert process.returncode == exit_code


RANK_NOT_LISTENING_YET = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a rank still importing, under a tool run by `nohup ... &`
print("rank: started", flush=True)
time.sleep(1.0)


def stop(signum, frame):
    print("rank: checkpoint saved", flush=True)
    sys.exit(130)


signal.signal(signal.SIGINT, stop)  # the loop's handler, installed once the model is built
time.sleep(60)
"""


def test_a_rank_that_missed_the_stop_gets_it_again_and_checkpoints_before_the_grace_ends(monkeypatch, tmp_path):
    """A stop that reaches a rank before it listens (SIGINT ignored, as a `nohup` tool's ranks inherit, while it
    imports or between two fine-tuning seeds) is sent again while the launch runs: the rank checkpoints within
    seconds, not trains on until the grace period ends and the launch is killed."""
    import time

    from concept_encoder.common import process_group

    monkeypatch.setattr(process_group, "RESEND_EVERY", 0.2)
    rank = tmp_path / "rank.py"
    rank.write_text(RANK_NOT_LISTENING_YET)
    launcher = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, {str(rank)!r}]))"
    launch = process_group.start([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    assert launch.stdout.readline().strip() == "rank: started"
    began = time.monotonic()
    ranks = process_group.interrupt_ranks([launch])  # ignored: the rank does not listen yet
    assert len(ranks[launch]) == 1
    process_group.wait_for_launches(ranks, grace=30)
    assert time.monotonic() - began < 15  # not the 30 s grace
    assert launch.stdout.read().strip() == "rank: checkpoint saved" and launch.returncode == 130


def test_a_stop_while_the_launch_starts_is_held_until_the_launch_is_in_hand(monkeypatch):
    """SIGTERM in the instant between `Popen` and the wait: held, then raised as `Terminated` with the launch in
    hand, which ends; never the caller's handler (by default: the tool ends alone, the launch trains on)."""
    import os
    import signal

    from concept_encoder.common import process_group
    from concept_encoder.common.entry import Terminated

    def callers_handler(signum, frame):
        raise RuntimeError("the SIGTERM reached the caller's handler: the launch was left running")

    real_start, started = process_group.start, []

    def start_then_sigterm(command, **kwargs):
        started.append(real_start(command, **kwargs))
        os.kill(os.getpid(), signal.SIGTERM)  # delivered at once, to a handler that must hold it
        return started[-1]

    monkeypatch.setattr(process_group, "start", start_then_sigterm)
    before = signal.signal(signal.SIGTERM, callers_handler)
    try:
        with pytest.raises(Terminated):
            process_group.call_interrupting_ranks([sys.executable, "-c", "import time; time.sleep(60)"])
        assert signal.getsignal(signal.SIGTERM) is callers_handler  # the caller's handler is back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert started[0].poll() is not None  # the launch ended with the tool


def test_a_tool_that_ignores_sigint_keeps_ignoring_it_while_it_waits_on_a_launch(monkeypatch):
    """A background job without job control (`nohup ... &`) runs with SIGINT ignored; waiting on a launch must not
    turn a stray SIGINT into a stop."""
    import signal

    from concept_encoder.common import process_group

    real_start, seen = process_group.start, []

    def start_and_look(command, **kwargs):
        seen.append(signal.getsignal(signal.SIGINT))
        return real_start(command, **kwargs)

    monkeypatch.setattr(process_group, "start", start_and_look)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert process_group.call_interrupting_ranks([sys.executable, "-c", "pass"]) == 0
        assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_jobs_at_once_run_together_and_keep_their_order(tmp_path):
    """Two launches that each wait for the other's file: they end only when run at the same time."""
    from concept_encoder.common import process_group

    meet = "import pathlib, sys, time\nmine, theirs = map(pathlib.Path, sys.argv[1:])\nmine.touch()\n" \
           "end = time.time() + 60\nwhile not theirs.exists() and time.time() < end: time.sleep(0.05)\n" \
           "sys.exit(0 if theirs.exists() else 1)"  # fmt: skip

    def job(mine, theirs, answer):
        return lambda: (process_group.call_interrupting_ranks([sys.executable, "-c", meet, mine, theirs]), answer)

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert process_group.run_at_once([job(a, b, "first"), job(b, a, "second")], workers=2) == [
        (0, "first"),
        (0, "second"),
    ]


def test_a_failed_job_lets_the_running_one_finish_and_starts_no_more():
    import threading
    import time

    from concept_encoder.common import process_group

    failing, finished, started = threading.Event(), [], []

    def running():
        assert failing.wait(30)  # it is still running when the other fails
        time.sleep(0.2)  # its worker free only after the failure was recorded: "no more" is then what is tested
        finished.append("running")
        return "running"

    def fails():
        failing.set()
        raise RuntimeError("the second job failed")

    with pytest.raises(RuntimeError, match="the second job failed"):
        process_group.run_at_once([running, fails, lambda: started.append("third")], workers=2)
    assert finished == ["running"] and started == []


def test_every_failed_job_is_named_on_the_error_raised():
    """Two jobs failing together: the first (in the jobs' order) is raised, the other's message is on it as a note
    (its traceback shows both), so one rerun mends them all."""
    import threading

    from concept_encoder.common import process_group

    together = threading.Barrier(2)

    def fails(what):
        def job():
            together.wait(30)  # both running when they fail
            raise RuntimeError(f"the {what} job failed")

        return job

    with pytest.raises(RuntimeError, match="the first job failed") as caught:
        process_group.run_at_once([fails("first"), fails("second")], workers=2)
    assert caught.value.__notes__ == ["another job failed too: RuntimeError: the second job failed"]


def test_jobs_printing_at_once_print_whole_lines(capsys):
    """`print` writes its text and its newline in two calls: two jobs printing together (`--jobs 2`) must still
    give whole lines, each once, and a last print without its newline is ended by one; the terminal is given back
    after."""
    import sys
    import threading

    from concept_encoder.common import process_group

    together, terminal = threading.Barrier(2), sys.stdout

    def job(name):
        def printing():
            together.wait(30)  # both printing at the same time
            for index in range(300):
                print(f"{name}: line {index}, finished earlier, reused", flush=True)
            print(f"{name}: the end", end="")
            return name

        return printing

    assert process_group.run_at_once([job("A"), job("B")], workers=2) == ["A", "B"]
    assert sys.stdout is terminal
    printed = capsys.readouterr().out.splitlines()
    expected = [f"{name}: line {index}, finished earlier, reused" for name in "AB" for index in range(300)]
    assert sorted(printed) == sorted([*expected, "A: the end", "B: the end"])


def test_a_launch_among_others_is_relayed_in_whole_lines_and_its_progress_bar_now_and_then(capfdbinary, monkeypatch):
    """Beside other launches (`--jobs`), a launch's standard error reaches the terminal in whole lines (a line cut
    across reads arrives whole), blank redraws dropped, its progress bar's redraws as one line per
    `PROGRESS_EVERY` seconds (here: only the first), a last line without its newline kept."""
    import os
    import threading

    from concept_encoder.common import process_group

    monkeypatch.setattr(process_group, "PROGRESS_EVERY", 1e9)
    read, write = os.pipe()
    for piece in (b"step 1 1%\rstep 2 2%\r", b"a log li", b"ne\n\r      \rstep 3 3%\r", b"the end"):
        os.write(write, piece)
    os.close(write)
    with os.fdopen(read, "rb") as stream:
        process_group.relay_stderr(stream, threading.Event(), in_lines=True)
    assert capfdbinary.readouterr().err == b"step 1 1%\na log line\nthe end\n"


def test_one_launch_into_a_log_file_has_its_progress_bar_as_lines_now_and_then(capfdbinary, monkeypatch):
    """A driver's one launch whose standard error is a file (`nohup ... > log`, here pytest's capture) relays the
    progress bar's redraws as one line per `PROGRESS_EVERY` seconds, not every redraw; the log lines whole."""
    from concept_encoder.common import process_group

    monkeypatch.setattr(process_group, "PROGRESS_EVERY", 1e9)
    text = "".join(f"bar {step}%\r" for step in range(200)) + "a log line\n" + "bar 200%\r"
    launch = [sys.executable, "-c", f"import sys; sys.stderr.write({text!r})"]
    assert process_group.call_interrupting_ranks(launch) == 0
    assert capfdbinary.readouterr().err == b"bar 0%\na log line\n"


@pytest.mark.alone
def test_sigterm_stops_every_launch_running_at_once_at_a_checkpoint_and_starts_no_more(tmp_path):
    """A driver's `--jobs 2`: SIGTERM (or Ctrl-C) to the tool reaches the ranks of both running launches, which
    checkpoint; the third job never starts; the tool ends in one line, exit code 143."""
    import signal

    launch = tmp_path / "launch.py"
    launch.write_text(FAKE_LAUNCH)
    tool = ("import sys\nfrom concept_encoder.common.entry import run_tool\nfrom concept_encoder.common import "
            f"process_group\nlaunch = [sys.executable, {str(launch)!r}, 'launcher', 'training']\n"
            "jobs = [lambda: process_group.call_interrupting_ranks(launch) for _ in range(3)]\n"
            "sys.exit(run_tool(lambda a: process_group.run_at_once(jobs, workers=2), 'tool'))")  # fmt: skip
    process = subprocess.Popen([sys.executable, "-c", tool], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_terminal)  # fmt: skip
    seen = ""
    while seen.count("rank: training") < 2:  # both ranks training (their lines may interleave on the one pipe)
        line = process.stdout.readline()
        assert line, f"the tool ended before two ranks trained: {process.stderr.read()[-2000:]}"
        seen += line
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert out.count("rank: checkpoint saved") == 2 and "rank: training" not in out  # the third never started
    assert "Traceback" not in err and "ChildFailedError" not in err
    assert [line for line in err.splitlines() if line.strip()] == [
        "tool: interrupted (what finished is kept: rerun the same command to continue)"
    ]
    assert process.returncode == 143
