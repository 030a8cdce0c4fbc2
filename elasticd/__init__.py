"""elasticd: a fault-tolerant elastic training daemon for PyTorch, and the library its workers import."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
