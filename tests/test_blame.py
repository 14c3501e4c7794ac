"""hplan.blame: an error is the workload's when its deepest registered-file frame has no hplan code below it."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

from hplan.blame import describe_user_error, register_user_file, user_frame
from hplan.errors import HplanError

USER_CODE = textwrap.dedent("""
    def fails():
        raise ValueError("bad value\\nsecond line")

    def calls(fn, *args):
        return fn(*args)
""")


@pytest.fixture
def user_module(tmp_path: Path):
    path = tmp_path / "user_code.py"
    path.write_text(USER_CODE)
    register_user_file(path)
    spec = importlib.util.spec_from_file_location("user_code_for_blame", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _raised(fn, *args) -> BaseException:
    with pytest.raises(BaseException) as info:
        fn(*args)
    return info.value


def test_an_error_raised_in_the_workload_file_is_blamed_on_its_line(user_module):
    exc = _raised(user_module.fails)
    assert user_frame(exc) == ("user_code.py", 3)
    assert describe_user_error(exc) == "error in your workload: ValueError: bad value (user_code.py:3)"


def test_library_code_the_workload_calls_into_is_still_the_workloads(user_module):
    exc = _raised(user_module.calls, int, "not a number")  # raised inside a builtin called from user code
    assert user_frame(exc) == ("user_code.py", 6)


def test_hplan_code_failing_below_the_users_frame_is_an_hplan_bug(user_module):
    from hplan.sizes import parse_size

    exc = _raised(user_module.calls, parse_size, "lots")  # hplan frame deeper than the user's
    assert isinstance(exc, HplanError) and user_frame(exc) is None and describe_user_error(exc) is None


def test_an_error_wrapped_by_hplan_keeps_the_users_location(user_module):
    try:
        try:
            user_module.fails()
        except ValueError:
            raise HplanError("the training step failed") from None
    except HplanError as exc:
        assert user_frame(exc) == ("user_code.py", 3)


def test_errors_outside_any_workload_file_are_not_blamed_on_the_user():
    assert user_frame(_raised(int, "x")) is None


def test_assigning_to_a_frozen_workload_is_the_users_error(tmp_path):
    """A frozen dataclass's generated __setattr__ (exec'd in hplan.workload's globals) refusing the user's
    assignment is the user's error at the assigning line, not an hplan bug."""
    path = tmp_path / "frozen_user.py"
    path.write_text("def assign(w):\n    w.loss = None\n")
    register_user_file(path)
    spec = importlib.util.spec_from_file_location("frozen_user_for_blame", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import hplan

    workload = hplan.Workload(model=lambda: None, batch=lambda s: None, loss=lambda m, b: None,
                              optimizer=lambda p: None)
    assert user_frame(_raised(module.assign, workload)) == ("frozen_user.py", 2)
