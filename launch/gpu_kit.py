"""Wheels for a bare GPU machine (`make gpu-kit`): what the lent GPU image lacks, built or fetched here into `.whl/`.

    python launch/gpu_kit.py                  # here, where PyPI answers: .whl/ and its manifest .whl/kit.json
    python launch/gpu_kit.py --ship pandas    # also ship a package the image was assumed to have
    python3 launch/gpu_kit.py --check         # there, after installing (docs/scaling.md): requirements all met?

The GPU image lent to this project has python3 3.12 with torch 2.11 (CUDA), transformers 5.17, accelerate 1.15,
pyarrow, scikit-learn and nvcc, but no DeepSpeed, no `datasets` and no network (issue #53): `make install` cannot
run there, so whatever `make gpu-check` needs beyond the image travels as wheels for CPython 3.12 on manylinux
x86-64, at most 64 MiB together with the working tree. The kit holds this project's own wheel, DeepSpeed's (built
here from its sdist, pure Python: its ops build just in time there, with nvcc), `datasets`, and every requirement
of theirs that `IMAGE` does not hold, each at the version installed here (the one the tests ran) where that fits.
Installed there with `pip install --no-index --no-deps --target`, nothing is resolved there, so `--check` compares
every shipped wheel's requirements with what that Python has, and names what to ship for each one missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / ".whl"
LIMIT_MIB = 64  # what travels to a lent GPU machine: the working tree and the kit together
# The marker environment of the image's python3 (3.12 on x86-64 Linux), and the wheels that install there.
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "os_name": "posix",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython"}  # fmt: skip
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")  # fmt: skip
ISSUE, TORCH, TRANSFORMERS = (
    "named by issue #53",
    "torch's requirement",
    "transformers' or huggingface-hub's requirement",
)
SEEN = "in the image's package list as read on a lent machine (2026-11), though nothing named above requires it"
# What the image holds, so the kit leaves it out: name -> (its version where known, why it is there). Versions
# are those read on a lent machine (2026-11); a requirement on a package listed without one is taken on trust
# and listed in the manifest, for `--check` to confirm there.
IMAGE = {
    "torch": ("2.11.0", ISSUE), "transformers": ("5.17.0", ISSUE), "accelerate": ("1.15.0", ISSUE),
    "pyarrow": (None, ISSUE), "scikit-learn": (None, ISSUE),
    **dict.fromkeys(("filelock", "fsspec", "jinja2", "markupsafe", "networkx", "sympy", "mpmath",
                     "typing-extensions", "setuptools", "triton"), (None, TORCH)),
    "numpy": ("2.5.2", TRANSFORMERS), "huggingface-hub": ("1.33.0", TRANSFORMERS),
    "tokenizers": ("0.23.2", TRANSFORMERS), "safetensors": ("0.8.0", TRANSFORMERS),
    **dict.fromkeys(("packaging", "pyyaml", "regex", "tqdm", "httpx", "hf-xet", "typer"), (None, TRANSFORMERS)),
    "psutil": (None, "accelerate's requirement"),
    **dict.fromkeys(("scipy", "joblib", "threadpoolctl"), (None, "scikit-learn's requirement")),
    **dict.fromkeys(("pandas", "matplotlib", "pillow", "contourpy", "cycler", "fonttools", "kiwisolver",
                     "pyparsing", "python-dateutil", "six", "ninja", "msgpack", "einops", "py-cpuinfo", "xxhash",
                     "requests", "aiohttp", "nvidia-ml-py"), (None, SEEN)),
}  # fmt: skip
# Shipped though the image has them: name -> why the image's copy is not relied on.
SHIP_ANYWAY = {"typing-extensions": "pydantic-core needs a recent one, the image's version is unknown, and a newer one "
               "only adds names, so it can shadow the image's safely"}  # fmt: skip
# Requirements of the project the kit leaves out on purpose: name -> why nothing in `make gpu-check` needs it.
LEFT_OUT = {"wandb": "only for --report_to wandb; gpu_check's runs report to none (and the image has no network)"}


@dataclasses.dataclass
class Dist:
    """A wheel: its distribution name and version, its `Requires-Dist` lines, its file (None in a plan's test)."""

    name: str
    version: str
    requires: list[str]
    path: Path | None = None


@dataclasses.dataclass
class Plan:
    shipped: dict[str, Dist] = dataclasses.field(default_factory=dict)  # by canonical name
    required_by: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    assumed: list[dict] = dataclasses.field(default_factory=list)  # requirements the image is taken to meet
    left_out: list[dict] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)


def wanted(requires: list[str], environment: dict | None = TARGET, extras=("",)) -> list[Requirement]:
    """The requirements among `requires` that apply to `environment` (the image's by default; None: this Python's)
    for the `extras` asked for ("" being none)."""
    out = []
    for line in requires:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or any(marker.evaluate({**(environment or {}), "extra": e}) for e in extras):
            out.append(requirement)
    return out


def resolve(built: list[Dist], fetch, local_version, image: dict = IMAGE) -> Plan:
    """The kit for `built` (the wheels made here): each requirement, level by level, is met by the image (`image`:
    checked where its version is known, else listed as assumed), left out (`LEFT_OUT`), or shipped: `fetch(specs)`
    gets wheels for `name==version` specs (or a specifier), the version installed here (`local_version(name)`)
    where it fits. A shipped version that a later requirement excludes, or an image version that one excludes,
    is a problem, one line each."""
    plan = Plan(shipped={canonicalize_name(d.name): d for d in built})
    queue = [(requirement, dist.name) for dist in built for requirement in wanted(dist.requires)]
    while queue:
        to_fetch: dict[str, tuple[Requirement, str]] = {}
        for requirement, by in queue:
            name = canonicalize_name(requirement.name)
            plan.required_by.setdefault(name, set()).add(by)
            if name in LEFT_OUT:
                plan.left_out.append({"requirement": str(requirement), "by": by, "why": LEFT_OUT[name]})
            elif name in image:
                version, why = image[name]
                if version is not None and not requirement.specifier.contains(version, prereleases=True):
                    plan.problems.append(f"{by} needs {requirement}, but the GPU image has {name} {version}: "
                                         f"pin a {by} that accepts it, or ship {name} (--ship {name})")  # fmt: skip
                plan.assumed.append({"requirement": str(requirement), "by": by, "image_version": version, "why": why})
            elif name in plan.shipped:
                if not requirement.specifier.contains(plan.shipped[name].version, prereleases=True):
                    plan.problems.append(f"{by} needs {requirement}, but the kit holds {name} "
                                         f"{plan.shipped[name].version} for {sorted(plan.required_by[name])}")  # fmt: skip
            elif name in to_fetch:
                earlier, first_by = to_fetch[name]
                merged = Requirement(f"{name}{earlier.specifier & requirement.specifier}")
                to_fetch[name] = (merged, f"{first_by}, {by}")
            else:
                to_fetch[name] = (requirement, by)
        specs = []
        for name, (requirement, _) in to_fetch.items():
            local = local_version(name)
            fits = local is not None and requirement.specifier.contains(local, prereleases=True)
            specs.append(f"{name}=={local}" if fits else f"{name}{requirement.specifier}")
        fetched = fetch(specs) if specs else {}
        queue = []
        for name, (requirement, _) in to_fetch.items():
            dist = fetched[name]
            plan.shipped[name] = dist
            queue += [(r, dist.name) for r in wanted(dist.requires, extras=("", *requirement.extras))]
    return plan


def image_without(ship: list[str]) -> dict:
    """`IMAGE` less `SHIP_ANYWAY` and the packages `--ship` names (the fix `--check` names for one missing there)."""
    leave = {canonicalize_name(name) for name in [*SHIP_ANYWAY, *ship]}
    return {name: held for name, held in IMAGE.items() if name not in leave}


def over_limit(kit_bytes: int, tree_bytes: int, limit_mib: float = LIMIT_MIB) -> str | None:
    """Why the kit cannot travel, in one line, or None: the kit and the working tree together over `limit_mib`."""
    total = (kit_bytes + tree_bytes) / 2**20
    if total <= limit_mib:
        return None
    return (f"the kit ({kit_bytes / 2**20:.1f} MiB) and the working tree ({tree_bytes / 2**20:.1f} MiB) come to "
            f"{total:.1f} MiB, over the {limit_mib:g} MiB that travel to a lent GPU machine: ship fewer packages "
            "(IMAGE in launch/gpu_kit.py lists what the image has) or make the working tree smaller")  # fmt: skip


# --- building (here, with PyPI) --------------------------------------------------------------------------------


def metadata(wheel: Path) -> Dist:
    """A wheel's name, version and requirements, read from its `*.dist-info/METADATA`."""
    with zipfile.ZipFile(wheel) as archive:
        [member] = [n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        message = Parser().parsestr(archive.read(member).decode())
    return Dist(message["Name"], message["Version"], message.get_all("Requires-Dist") or [], wheel)


def pip(*args: str, env: dict | None = None) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no output"]
        raise SystemExit(f"error: pip {args[0]} {' '.join(a for a in args[1:] if not a.startswith('-'))} failed "
                         f"({last[0]}); `make gpu-kit` needs PyPI")  # fmt: skip


def isolation() -> list[str]:
    """pip's build flags: this environment's setuptools where it has one (torch importable to DeepSpeed's setup,
    nothing downloaded), else an isolated build that fetches it."""
    return ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []


def tracked_files() -> list[Path]:
    """The working tree that travels to a lent GPU machine: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return [ROOT / name for name in out.split("\0") if name and (ROOT / name).is_file()]


def build_project(into: Path, scratch: Path) -> Path:
    """This project's wheel, built from a copy of the files that travel (no stale `build/` leftovers in it)."""
    source = scratch / "source"
    into.mkdir(parents=True, exist_ok=True)
    for path in tracked_files():
        target = source / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    pip("wheel", "-q", "--no-deps", *isolation(), "-w", str(into), str(source))
    return next(into.glob("concept_encoder-*.whl"))


def build_deepspeed(into: Path) -> Path:
    """DeepSpeed's wheel from its sdist at the version installed here, ops not compiled (`DS_BUILD_OPS=0`): pure
    Python, so it installs on the image's Python 3.12, where DeepSpeed builds each op with nvcc when first used."""
    version = importlib.metadata.version("deepspeed")
    pip("wheel", "-q", "--no-deps", *isolation(), "--no-binary", "deepspeed", "-w", str(into),
        f"deepspeed=={version}", env={**os.environ, "DS_BUILD_OPS": "0"})  # fmt: skip
    wheel = next(into.glob("deepspeed-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        compiled = [n for n in archive.namelist() if n.endswith(".so")]
    if not wheel.name.endswith("-py3-none-any.whl") or compiled:
        raise SystemExit(f"error: {wheel.name} is not pure Python ({compiled[:3]}): it compiled ops for this "
                         "machine; build it with DS_BUILD_OPS=0 and no DS_BUILD_* set")  # fmt: skip
    return wheel


def fetcher(into: Path):
    """`fetch(specs)` for `resolve`: wheels for CPython 3.12 on manylinux x86-64 from PyPI, one pip call a level."""

    def fetch(specs: list[str]) -> dict[str, Dist]:
        before = set(into.glob("*.whl"))
        flags = [f"--platform={p}" for p in PLATFORMS]
        pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation",
            "cp", *flags, "-d", str(into), *specs)  # fmt: skip
        fetched = [metadata(wheel) for wheel in set(into.glob("*.whl")) - before]
        return {canonicalize_name(d.name): d for d in fetched}

    return fetch


def local_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def build(kit: Path, image: dict) -> int:
    with tempfile.TemporaryDirectory(prefix="gpu-kit-") as scratch:
        wheels = Path(scratch) / "wheels"
        wheels.mkdir()
        print("gpu-kit: building this project's wheel and DeepSpeed's (pure Python) ...", flush=True)
        built = [metadata(build_project(wheels, Path(scratch))), metadata(build_deepspeed(wheels))]
        print("gpu-kit: resolving their requirements against the GPU image ...", flush=True)
        plan = resolve(built, fetcher(wheels), local_version, image)
        if plan.problems:
            print("\n".join(f"error: {problem}" for problem in plan.problems), file=sys.stderr)
            return 1
        kit_bytes = sum(d.path.stat().st_size for d in plan.shipped.values())
        if problem := over_limit(kit_bytes, sum(p.stat().st_size for p in tracked_files())):
            print(f"error: {problem}", file=sys.stderr)
            return 1
        kit.mkdir(exist_ok=True)
        for old in [*kit.glob("*.whl"), kit / "kit.json"]:  # two versions of one package stop the install
            old.unlink(missing_ok=True)
        for dist in plan.shipped.values():
            shutil.copy2(dist.path, kit / dist.path.name)
    write_manifest(kit, plan, kit_bytes)
    return 0


def write_manifest(kit: Path, plan: Plan, kit_bytes: int) -> None:
    shipped = sorted(plan.shipped.items())
    rows = [{"name": d.name, "version": d.version, "wheel": d.path.name, "bytes": (kit / d.path.name).stat().st_size,
             "required_by": sorted(plan.required_by.get(name, [])) or ["the kit"]} for name, d in shipped]  # fmt: skip
    manifest = {"target": TARGET, "platforms": PLATFORMS, "bytes": kit_bytes, "shipped": rows,
                "assumed_in_image": plan.assumed, "left_out": plan.left_out}  # fmt: skip
    (kit / "kit.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print("\n| wheel | MiB | required by |\n|---|---|---|")
    for row in rows:
        print(f"| {row['wheel']} | {row['bytes'] / 2**20:.2f} | {', '.join(row['required_by'])} |")
    unknown = sorted({a["requirement"] for a in plan.assumed if a["image_version"] is None
                      and Requirement(a["requirement"]).specifier})  # fmt: skip
    print(f"\n{len(rows)} wheels, {kit_bytes / 2**20:.1f} MiB in {kit.relative_to(ROOT)}/ (manifest: kit.json); "
          f"left out: {', '.join(sorted({x['requirement'] for x in plan.left_out})) or 'nothing'}")  # fmt: skip
    if unknown:
        print(f"taken on trust from the image (versions unknown here; `--check` there confirms): {', '.join(unknown)}")


# --- checking (there, after the install) -----------------------------------------------------------------------


KIT_MODULES = ("concept_encoder", "deepspeed", "datasets")  # what the kit exists for


def check(kit: Path, modules=KIT_MODULES) -> int:
    """Every wheel of `kit` installed here (found first on the path) and each of its requirements met by this
    Python; then `modules` imported. One line per problem, with the fix."""
    problems = [] if list(kit.glob("*.whl")) else [f"no wheels in {kit}: `make gpu-kit` where pip works, carry .whl/"]
    for wheel in sorted(kit.glob("*.whl")):
        dist = metadata(wheel)
        have = local_version(dist.name)
        if have != dist.version:
            problems.append(f"{dist.name} {dist.version} is not what this Python finds ({have or 'nothing'}): "
                            "install the kit and put its folder first on PYTHONPATH (docs/scaling.md)")  # fmt: skip
            continue
        for requirement in wanted(dist.requires, environment=None):
            found = local_version(requirement.name)
            if canonicalize_name(requirement.name) in LEFT_OUT:
                continue
            if found is None or not requirement.specifier.contains(found, prereleases=True):
                problems.append(f"{dist.name} needs {requirement}, and this Python has {found or 'none'}: where pip "
                                f"works, `make gpu-kit KIT_ARGS='--ship {requirement.name}'`, carry .whl/ again")  # fmt: skip
    for module in modules:
        try:
            __import__(module)
        except Exception as error:  # an extension built for another Python, a missing dependency
            problems.append(f"import {module} fails: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    wheels = len(list(kit.glob("*.whl")))
    ok = f"gpu-kit check: ok: the {wheels} wheels of {kit} installed, their requirements met, {', '.join(modules)} import"
    print("\n".join(f"gpu-kit check: {p}" for p in problems) or ok)
    return 1 if problems else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ship", action="append", default=[], metavar="NAME", help="ship NAME though IMAGE has it")
    parser.add_argument("--check", action="store_true", help="on the GPU machine: are the kit's requirements met?")
    parser.add_argument("--kit", type=Path, default=KIT, help="the kit's folder (default .whl/)")
    args = parser.parse_args(argv)
    if args.check:
        return check(args.kit)
    return build(args.kit.resolve(), image_without(args.ship))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere
    from concept_encoder.common.entry import run_tool

    sys.exit(run_tool(main, "launch/gpu_kit.py"))
