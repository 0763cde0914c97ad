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
    if len(items) > 100:  # the whole suite collected: its multi-rank launches are among them
        assert any("test_deepspeed.py" in nodeid for nodeid in marked)
        assert "tests/test_loop.py::test_two_process_cpu_run_ranks_agree[False]" in marked
