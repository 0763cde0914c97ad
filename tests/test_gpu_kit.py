"""`make gpu-kit` (launch/gpu_kit.py): which wheels travel to a bare GPU image, checked offline: the plan against
the metadata installed here, the conflicts it names, the size limit, the check run there, and the project's wheel."""

import importlib.metadata
import importlib.util
import shutil
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from launch import gpu_kit
from launch.gpu_kit import Dist


def installed(name: str) -> Dist:
    dist = importlib.metadata.distribution(name)
    return Dist(dist.metadata["Name"], dist.version, dist.requires or [])


def test_the_kit_ships_what_the_image_lacks_at_the_versions_tested_here():
    """The plan for this project and DeepSpeed, with the metadata installed here standing in for PyPI."""
    asked = []

    def fetch(specs):
        asked.extend(specs)
        return {canonicalize_name(Requirement(s).name): installed(Requirement(s).name) for s in specs}

    built = [installed("concept-encoder"), installed("deepspeed")]
    plan = gpu_kit.resolve(built, fetch, gpu_kit.local_version, gpu_kit.image_without([]))
    assert plan.problems == []
    assert set(plan.shipped) == {
        "concept-encoder", "deepspeed", "datasets", "dill", "multiprocess", "hjson", "pydantic", "pydantic-core",
        "annotated-types", "typing-inspection", "typing-extensions",
    }  # fmt: skip
    assert all(f"=={gpu_kit.local_version(Requirement(s).name)}" in s for s in asked), asked  # the tested versions
    assert [x["requirement"] for x in plan.left_out] == ["wandb>=0.18"]
    assert not set(plan.shipped) & (set(gpu_kit.IMAGE) - set(gpu_kit.SHIP_ANYWAY))
    assert "transformers<6,>=5.0" in {a["requirement"] for a in plan.assumed}  # met by the image's 5.17.0


def test_the_plan_names_a_requirement_the_image_or_the_kit_cannot_meet_and_skips_other_platforms():
    index = {"tiny": Dist("tiny", "1.0", ["leaf<1"]), "leaf": Dist("leaf", "0.9", ["tiny>=2"])}
    asked = []

    def fetch(specs):
        asked.append(specs)
        return {canonicalize_name(Requirement(s).name): index[Requirement(s).name] for s in specs}

    root = Dist("concept-encoder", "0.1.0", ["huggingface-hub>=2.0", "tiny>=1.0", 'tomli; python_version < "3.11"'])
    local = {"tiny": "1.0", "leaf": "1.5"}.get  # leaf 1.5 is installed here but does not fit `leaf<1`
    plan = gpu_kit.resolve([root], fetch, local, gpu_kit.IMAGE)
    assert asked == [["tiny==1.0"], ["leaf<1"]]  # no tomli: the image's Python is 3.12
    assert plan.problems == [
        "concept-encoder needs huggingface-hub>=2.0, but the GPU image has huggingface-hub 1.33.0: pin a "
        "concept-encoder that accepts it, or ship huggingface-hub (--ship huggingface-hub)",
        "leaf needs tiny>=2, but the kit holds tiny 1.0 for ['concept-encoder', 'leaf']",
    ]
    assert "huggingface-hub" in gpu_kit.image_without([]) and "huggingface-hub" not in gpu_kit.image_without(
        ["huggingface_hub"]
    )


def test_the_kit_and_the_working_tree_must_fit_what_travels():
    mib = 2**20
    assert gpu_kit.over_limit(50 * mib, 13 * mib) is None
    message = gpu_kit.over_limit(60 * mib, 5 * mib)
    assert "kit (60.0 MiB) and the working tree (5.0 MiB) come to 65.0 MiB, over the 64 MiB" in message


def fake_wheel(folder, name: str, version: str, requires: list[str]) -> None:
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"] + [
        f"Requires-Dist: {r}" for r in requires
    ]
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")


def test_the_check_on_the_gpu_machine_names_each_unmet_requirement_and_its_fix(tmp_path, capsys):
    hjson = gpu_kit.local_version("hjson")
    requires = ["packaging>=1", "no-such-dist-xyz>=1", "wandb>=0.1", 'tomli; python_version < "3.0"']
    fake_wheel(tmp_path, "hjson", hjson, requires)
    fake_wheel(tmp_path, "pydantic", "0.0.1", [])  # another version than the one installed here
    assert gpu_kit.check(tmp_path, modules=("json", "no_such_module_xyz")) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "gpu-kit check: hjson needs no-such-dist-xyz>=1, and this Python has none: where pip works, "
        "`make gpu-kit KIT_ARGS='--ship no-such-dist-xyz'`, carry .whl/ again",
        f"gpu-kit check: pydantic 0.0.1 is not what this Python finds ({gpu_kit.local_version('pydantic')}): "
        "install the kit and put its folder first on PYTHONPATH (docs/scaling.md)",
        "gpu-kit check: import no_such_module_xyz fails: ModuleNotFoundError: No module named 'no_such_module_xyz'",
    ]
    (tmp_path / "pydantic-0.0.1-py3-none-any.whl").unlink()
    fake_wheel(tmp_path, "hjson", hjson, ["packaging>=1"])
    assert gpu_kit.check(tmp_path, modules=("json",)) == 0
    assert "ok: the 1 wheels" in capsys.readouterr().out
    assert gpu_kit.check(tmp_path / "not-carried", modules=()) == 1
    assert "no wheels in" in capsys.readouterr().out


@pytest.mark.skipif(
    not (gpu_kit.ROOT / ".git").exists() or shutil.which("git") is None or not importlib.util.find_spec("setuptools"),
    reason="needs a git checkout and setuptools (no download in the tests)",
)
def test_the_project_wheel_builds_from_the_files_that_travel(tmp_path):
    wheel = gpu_kit.build_project(tmp_path / "wheels", tmp_path)
    dist = gpu_kit.metadata(wheel)
    assert (dist.name, wheel.name) == ("concept-encoder", f"concept_encoder-{dist.version}-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "concept_encoder/common/process_group.py" in names
    assert not [n for n in names if n.startswith(("tests/", "loops/", "build/"))]
