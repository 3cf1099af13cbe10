"""The error a ``tidal`` subcommand raises for an argument it cannot use.

Its own module so that the argument helpers (``tidal.compiler.cli_args``) and the MODEL loader
(``tidal.compiler.model_spec``) both raise it without importing each other. Imports no torch.

Example:
    >>> from tidal.compiler.cli_errors import UsageError
    >>> from tidal.ir.errors import TidalError
    >>> err = UsageError("--batch 0: must be at least 1")
    >>> isinstance(err, TidalError) and isinstance(err, ValueError), str(err)
    (True, '--batch 0: must be at least 1')
"""
from __future__ import annotations

from tidal.ir.errors import TidalError


class UsageError(TidalError, ValueError):
    """A command-line argument that cannot be used; the message names the argument."""
