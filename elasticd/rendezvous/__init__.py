"""Rendezvous over etcd v3 for torch elastic: the state backend (:mod:`.backend`), the c10d store
(:mod:`.store`) and the ``etcd-v3`` handler with its registration (:mod:`.handler`).

torch's rendezvous package is imported here first, on purpose: importing it loads every ``torchrun.handlers``
entry point, ours included (:func:`.handler.handler_factory`). Were :mod:`.handler` the module to trigger that
import, torch would find it half-initialised and log a failed plugin registration (a circular import).
"""

from __future__ import annotations

import torch.distributed.elastic.rendezvous  # noqa: F401  (see above: must precede our submodules)
