"""Every docstring example in the package runs."""
import doctest
import importlib
import pkgutil

import pytest

import tidal


def _modules():
    names = ["tidal"]
    for info in pkgutil.walk_packages(tidal.__path__, "tidal."):
        if not info.name.startswith(("tidal.tests", "tidal.examples", "tidal.benchmarks")) \
                and info.name not in ("tidal.__main__", "tidal.setup"):
            names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
