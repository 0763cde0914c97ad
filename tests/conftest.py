"""Every test writes its Cache/ relative to its own working folder (usually a tmp dir), never into the
checkout's: `CONCEPT_ENCODER_CACHE=Cache` makes `concept_encoder.common.paths.cache_root()` the current folder's.
Set at import, before any fixture (module-scoped ones included) runs a loop; subprocesses inherit it.

Two workers (`make test`: `pytest -n 2`): each pytest-xdist worker and every process it starts use one thread
(`CPU_THREADS=1`, read by `training.runtime.use_cpu_cores`, and `OMP_NUM_THREADS=1`), so the two share 2 cores
without oversubscribing them. A module is one unit of work (its module fixtures are built once), except the
tests marked `alone`: they launch several ranks or wait on a wall-clock deadline, and two multi-rank launches at
once on 2 cores leave ranks waiting on each other for a core, so they form one unit together, run one at a time
by one worker while the other takes the modules (`OneLaunchAtATime`).
"""

import ast
import functools
import os
from pathlib import Path

os.environ["CONCEPT_ENCODER_CACHE"] = "Cache"

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    os.environ["CPU_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

ALONE_GROUP = "tests marked alone"
ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def alone_tests(module: str) -> frozenset[str] | None:
    """The names of the test functions of `module` (a path from the checkout) marked `alone`, read from its
    source (the controller collects nothing); None when the whole module is (`pytestmark = pytest.mark.alone`)."""
    tree = ast.parse((ROOT / module).read_text())
    alone = "pytest.mark.alone"
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            if alone in ast.unparse(node.value):
                return None
    return frozenset(
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and any(alone in ast.unparse(d) for d in node.decorator_list)
    )


def is_alone(nodeid: str) -> bool:
    module, _, name = nodeid.partition("::")
    names = alone_tests(module)
    return names is None or name.split("[")[0] in names


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class OneLaunchAtATime(LoadScopeScheduling):
        """Units of work: each module, and the `alone` tests of every module together. Handed out in the
        workers' collection order (`pytest_collection_modifyitems` below), not by size."""

        def _split_scope(self, nodeid: str) -> str:
            return ALONE_GROUP if is_alone(nodeid) else nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False
    return OneLaunchAtATime(config, log)


# the modules measured slowest (docs/results.md, "The test suite's time"), handed out first; only the order
# depends on this list (a module missing from it is placed by its count of whole training loops)
SLOWEST_FIRST = ("test_benchmarks.py", "test_finetune.py", "test_loop.py", "test_package.py",
                 "test_listops_training.py", "test_long_context.py", "test_compile.py", "test_curve.py")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """Under workers, the order units are handed out in: the `alone` tests first (the longest unit), then the
    slowest modules, then the rest by their count of whole training loops, except that the lightest module comes
    second: a worker is given two units at the start, and the one queued behind the `alone` tests waits for them."""
    if not WORKER:
        return
    loops: dict[Path, int] = {}
    for item in items:
        loops[item.path] = loops.get(item.path, 0) + bool(item.get_closest_marker("loop"))

    def weight(path: Path) -> tuple[int, int]:
        listed = SLOWEST_FIRST.index(path.name) if path.name in SLOWEST_FIRST else len(SLOWEST_FIRST)
        return listed, -loops[path]

    modules = sorted(loops, key=weight)  # stable: ties keep the collection's order
    modules.insert(1, modules.pop())
    rank = {path: index for index, path in enumerate(modules)}
    items.sort(key=lambda item: (not is_alone(item.nodeid), rank[item.path]))  # stable within a module
