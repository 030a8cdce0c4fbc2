"""Name torch's rendezvous events from the caller's frame instead of a walk of the whole stack.

torch's dynamic rendezvous names each event it records (``_record`` of its state holder, operation executor and
handler) with ``get_method_name()``, which calls ``inspect.stack()`` twice: every frame of the thread with its
source line, and for each frame a scan of every loaded module (``inspect.getmodule``). In a daemon (1,500 modules,
~30 frames) one call costs ~6 ms of CPU, spent before torch looks whether anyone listens (by default nobody: the
event handler is a ``NullHandler``). It runs on each keep-alive and each pass of the join loop, which our wake-up
(``wakeup.py``) runs on every state change rather than once a second: profiled in the suite (py-spy, a daemon while
rounds re-formed), 77 % of its busy samples were in this one function.

:func:`install` replaces it, for the whole process, with the same answer read from the frame ``depth`` levels up
(``sys._getframe``). When torch's use of it moved (``privates/torch_surfaces.py``, fallback
``torch_event_names``) torch is left as it is: more CPU, the same behaviour.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from elasticd.privates.check import problems
from elasticd.privates.surface import Fallback
from elasticd.privates.torch_surfaces import TORCH

_lock = threading.Lock()


def method_name(depth: int = 2) -> str:
    """torch's ``get_method_name``: the name of the function ``depth`` frames above this one (its caller is 1)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def install() -> bool:
    """Put :func:`method_name` in torch's place (idempotent); False, torch untouched, when its use of it moved."""
    with _lock:
        current: Callable[..., str] | None = getattr(dynamic_rendezvous, "get_method_name", None)
        if current is method_name:
            return True
        if problems(TORCH, fallback=Fallback.TORCH_EVENT_NAMES):
            return False
        dynamic_rendezvous.get_method_name = method_name
        return True
