"""The suite's own scheduling (tests/conftest.py): the tests `make test` runs one at a time are exactly the ones
marked `alone`, as pytest reads the marks."""

from conftest import is_alone


def test_the_alone_tests_read_from_the_source_are_the_ones_pytest_marks(request):
    """The scheduler (in the controller, which collects nothing) reads the `alone` marks from the modules' source;
    a mark it cannot read (e.g. one set through `pytest.param(marks=...)`) would put a multi-rank launch beside
    the other worker's tests."""
    items = request.session.items
    marked = {item.nodeid for item in items if item.get_closest_marker("alone")}
    read = {item.nodeid for item in items if is_alone(item.nodeid)}
    assert read == marked, f"marked but not read: {sorted(marked - read)}; read but not marked: {sorted(read - marked)}"
    deepspeed = {item.nodeid for item in items if item.path.name == "test_deepspeed.py"}
    assert deepspeed <= marked, "every DeepSpeed launch test is marked alone (the module's pytestmark)"
    two_process = {item.nodeid for item in items if "two_process" in item.name}
    assert two_process <= marked, f"multi-rank launches not marked alone: {sorted(two_process - marked)}"
