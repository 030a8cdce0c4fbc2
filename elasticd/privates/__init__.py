"""The one seam for private torch and accelerate surfaces: what elasticd may touch, and what breaks on upgrade.

Every ``_``-prefixed torch or accelerate name elasticd uses (an attribute, a private module or class, a private
method an elasticd subclass overrides, a module-level function replaced) is an entry of one table per package:
:data:`elasticd.privates.torch_surfaces.TORCH` and :data:`elasticd.privates.accelerate_surfaces.ACCELERATE`. An entry
says who uses the name, what for, how to check that it is still what we rely on, and the :class:`~.surface.Fallback`
when it is not. :mod:`.check` runs the checks at start (``elasticd start``, the worker library's ``attach`` and the
hot path's arm) and applies the fallbacks; ``tests/unit/test_privates.py`` runs every check against the installed
releases and scans the source for a private name no table lists.

Nothing here imports torch or accelerate at module level: each check imports what it looks at when it runs.
"""
