"""Packaging: the repository root is the package ``tidal`` (metadata lives in setup.cfg).

Every sub-package below the root is installed as ``tidal.<name>``; tests, examples and
benchmarks are not installed."""
from setuptools import find_packages, setup

SUBPACKAGES = find_packages(".", exclude=("tests*", "examples*", "benchmarks*", "build*"))

setup(packages=["tidal"] + [f"tidal.{p}" for p in SUBPACKAGES])
