"""What the machine is: torch, CUDA and the GPU, Python, and the versions (and where from) of
the packages tidal needs, so the table says what ran and a missing wheel shows first."""
from __future__ import annotations

import importlib
import os
import platform
import sys

import torch

from benchmarks.gpu_check.common import fail
from benchmarks.gpu_check.wheels import pinned

SUMMARY = ("gpu", "torch", "cuda", "python", "transformers", "tidal")
PACKAGES = ("transformers", "tokenizers", "huggingface_hub", "pydot", "pyparsing", "numpy",
            "sympy", "networkx", "safetensors")


def run(device: str, quick: bool) -> dict:
    dev = torch.device(device)
    figures: dict = {"torch": torch.__version__, "cuda": torch.version.cuda or "none",
                     "python": platform.python_version(), "cpus": os.cpu_count(),
                     "executable": sys.executable}
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} asked, and torch.cuda.is_available() is "
                               f"False (torch {torch.__version__})")
        props = torch.cuda.get_device_properties(dev)
        figures.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                       gpu_memory_gib=round(props.total_memory / 2**30, 1),
                       gpus=torch.cuda.device_count())
    else:
        figures["gpu"] = f"none ({platform.processor() or platform.machine()})"
    for name in PACKAGES:
        try:
            mod = importlib.import_module(name)
            figures[name] = getattr(mod, "__version__", "?")
            figures[f"{name}_from"] = os.path.dirname(os.path.dirname(mod.__file__ or ""))
        except Exception as e:  # noqa: BLE001 - a missing package is the finding
            figures[name] = "missing"
            fail(figures, f"import {name}: {type(e).__name__}: {e}")
    want = pinned("hf", "transformers").lstrip("=")
    if figures["transformers"] not in ("missing", want):
        fail(figures, f"transformers {figures['transformers']} is first on the path, tidal pins "
                      f"{want} (setup.cfg hf): run make gpu-wheels here, then make gpu-check")
    import tidal

    figures["tidal"] = tidal.__version__ if hasattr(tidal, "__version__") else "?"
    figures["tidal_from"] = os.path.dirname(tidal.__file__)
    return figures
