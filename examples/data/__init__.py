"""Offline data for the examples: English text and click logs.

- Text (the GPL-3 licence, kept verbatim): the file is split at the blank line nearest its
  middle; the first half calibrates, the second half evaluates (see README.md in this folder
  for the source).
- Click logs for recommendation models: :class:`ClickData` (synthetic, Zipf-skewed ids,
  :mod:`.clicks`) and :class:`CriteoTSV` (Criteo-format TSV files, :mod:`.criteo`).

Example:
    >>> from examples.data import calibration_text, evaluation_text
    >>> "GNU GENERAL PUBLIC LICENSE" in calibration_text()
    True
    >>> evaluation_text().lstrip().startswith("7. Additional Terms.")
    True
    >>> from examples.data import ClickData
    >>> ClickData(num_dense=2, table_rows=(10, 20), batch_size=3).batch(5)[0][1].shape
    torch.Size([3, 2])
"""
from __future__ import annotations

from pathlib import Path

from .clicks import ClickData
from .criteo import CriteoTSV

__all__ = ["ClickData", "CriteoTSV", "calibration_text", "evaluation_text"]

_SOURCE = Path(__file__).with_name("GPL-3.txt")


def _halves() -> tuple[str, str]:
    """The text cut after the first blank line at or past its middle character."""
    text = _SOURCE.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    seen = 0
    for i, line in enumerate(lines):
        seen += len(line)
        if seen >= len(text) // 2 and not line.strip():
            return "".join(lines[: i + 1]), "".join(lines[i + 1:])
    raise ValueError(f"{_SOURCE} has no blank line past its middle to split at")


def calibration_text() -> str:
    """The first half of the text (for choosing cluster counts)."""
    return _halves()[0]


def evaluation_text() -> str:
    """The second half of the text (held out; for measuring only)."""
    return _halves()[1]
