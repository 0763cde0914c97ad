"""The package's shape: a torch-free core, lazy public names, Auto registration, one-way imports."""

import ast
import importlib
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


def test_memory_presets_and_the_argument_module_import_without_torch():
    out = run_python(
        "import sys\n"
        "import concept_encoder.memory, concept_encoder.presets, concept_encoder.training.args\n"
        "import concept_encoder.training.plan, concept_encoder.constants\n"
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
    ],
    ids=["package-first", "transformers-first", "class-import"],
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
