"""Exceptions tidal raises for bad input, each naming the module, node or argument at fault."""
from __future__ import annotations


class TidalError(Exception):
    """Base class of every error tidal raises on purpose."""


class TraceError(TidalError):
    """A model could not be captured as a graph.

    Carries ``module_path`` (qualified path of the module being traced, '' for the root),
    ``module_type`` and ``location`` (``file:line`` of the user's source line, if known).
    """

    def __init__(self, message: str, *, module_path: str = "", module_type: str = "",
                 location: str = ""):
        super().__init__(message)
        self.module_path = module_path
        self.module_type = module_type
        self.location = location


class PassError(TidalError):
    """A pass could not run: a failed ``requires``/``ensures`` check, a lint error in the graph
    it produced, or bad pass options. The message starts with the pass name."""


class PlanError(TidalError):
    """A saved plan could not be read back (bad JSON, unknown kind, a field of the wrong type)."""
