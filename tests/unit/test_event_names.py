"""torch's rendezvous events are named from the caller's frame, with no stack walk (rendezvous/event_names.py)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings, _RendezvousState

from elasticd.rendezvous import event_names

TORCH_GET_METHOD_NAME = dynamic_rendezvous.get_method_name


@pytest.fixture
def torch_naming(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from torch's own function and leaves it so."""
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", TORCH_GET_METHOD_NAME)


def _record_like(name_of: Any) -> str:
    """Called as torch's ``_record`` calls it: the name is that of ``_record``'s caller."""
    return str(name_of())


def the_operation(name_of: Any) -> str:
    return _record_like(name_of)


@pytest.mark.usefixtures("torch_naming")
def test_the_name_is_torch_s_for_the_same_call_and_for_a_stack_too_short() -> None:
    assert the_operation(event_names.method_name) == the_operation(TORCH_GET_METHOD_NAME) == "the_operation"
    assert event_names.method_name(depth=10_000) == TORCH_GET_METHOD_NAME(depth=10_000) == "no_method_name"


@pytest.mark.usefixtures("torch_naming")
def test_a_recorded_event_walks_no_stack_once_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = RendezvousSettings("run", 1, 1, None, None, None)  # type: ignore[arg-type]
    holder = dynamic_rendezvous._BackendRendezvousStateHolder(backend=None, settings=settings)  # type: ignore[arg-type]
    holder._state = _RendezvousState()
    walks: list[int] = []
    real_stack = inspect.stack

    def counting_stack(*args: Any, **kwargs: Any) -> Any:
        walks.append(1)
        return real_stack(*args, **kwargs)

    monkeypatch.setattr(inspect, "stack", counting_stack)
    holder._record("torch's own naming")
    assert walks, "torch's _record no longer walks the stack: event_names.py has nothing left to replace"
    walks.clear()
    assert event_names.install() is True
    assert event_names.install() is True  # idempotent
    holder._record("ours")
    assert walks == []


@pytest.mark.usefixtures("torch_naming")
def test_torch_s_naming_is_kept_when_its_use_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", lambda: "moved")  # no depth parameter any more
    assert event_names.install() is False
    assert dynamic_rendezvous.get_method_name() == "moved"
