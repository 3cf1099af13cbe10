"""tidal: a compiler-style graph transformation toolkit for PyTorch.

``tidal.compile(model, example_inputs, passes=..., cluster=...)`` traces a model with torch.fx,
annotates per-layer costs, runs graph passes that apply published parallelism and
data-movement techniques, and returns a ``Compiled`` model with ``report()``, ``plan`` and
``dump(dir)``.

The public names are imported on first use (PEP 562), so ``import tidal`` and the command
line's ``--help`` do not import torch.

Example:
    >>> import torch, tidal
    >>> model = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 4)
    >>> torch.equal(tidal.compile(model, (x,))(x), model(x))
    True
"""
from __future__ import annotations

import importlib
import importlib.util
from types import MappingProxyType
from typing import Any

__version__ = "0.1.0"

_PUBLIC = MappingProxyType({
    # public name -> (module, attribute in it; None: the module itself)
    "compile": ("tidal.compiler.api", "compile"),
    "trace": ("tidal.ir.capture", "trace"),
    "capture_train_step": ("tidal.ir.capture", "capture_train_step"),
    "Compiled": ("tidal.compiler.compiled", "Compiled"),
    "Cluster": ("tidal.ir.cluster", "Cluster"),
    "DeviceProfile": ("tidal.ir.device_profile", "DeviceProfile"),
    "Pass": ("tidal.ir.pass_api", "Pass"),
    "PassContext": ("tidal.ir.pass_api", "PassContext"),
    "PassResult": ("tidal.ir.pass_api", "PassResult"),
    "Executor": ("tidal.ir.pass_api", "Executor"),
    "Plan": ("tidal.ir.plan", "Plan"),
    "CompiledPlan": ("tidal.ir.plan", "CompiledPlan"),
    "passes": ("tidal.passes", None),      # tidal.passes.registry(): the registered passes
    "hooks": ("tidal.hooks", None),        # DDP communication hooks
    "checkpoint": ("tidal.compiler.checkpoint", None),   # DCP get/set_state_dict
    "TidalError": ("tidal.ir.errors", "TidalError"),
    "TraceError": ("tidal.ir.errors", "TraceError"),
    "PassError": ("tidal.ir.errors", "PassError"),
    "PlanError": ("tidal.ir.errors", "PlanError"),
    # what a training loop may catch by name (README: Training loops)
    "OpenStepError": ("tidal.runtime.program", "OpenStepError"),
    "StepGuardError": ("tidal.compiler.guards", "StepGuardError"),
    "BatchError": ("tidal.runtime.batch_data", "BatchError"),
    "BufferUpdateError": ("tidal.ir.capture", "BufferUpdateError"),
    "StaleStateError": ("tidal.runtime.programs.burst_refresh", "StaleStateError"),
    "PeerFailureError": ("tidal.runtime.peer_failures", "PeerFailureError"),
    "StepMismatchError": ("tidal.runtime.programs.step_failures", "StepMismatchError"),
})

__all__ = [
    "compile", "trace", "capture_train_step", "Compiled", "Cluster", "DeviceProfile",
    "Pass", "PassContext", "PassResult", "Executor", "Plan", "CompiledPlan", "passes", "hooks",
    "checkpoint", "TidalError", "TraceError", "PassError", "PlanError", "OpenStepError", "StepGuardError",
    "BatchError", "BufferUpdateError", "StaleStateError", "PeerFailureError",
    "StepMismatchError", "__version__",
]


def __getattr__(name: str) -> Any:
    """Import a public name (or a subpackage such as ``tidal.ir``) on first access and keep it
    in the module's namespace."""
    if name in _PUBLIC:
        module_name, attr = _PUBLIC[name]
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        module_name, attr = f"{__name__}.{name}", None
    else:
        raise AttributeError(f"module 'tidal' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """Module attributes, the lazy public names included."""
    return sorted(set(globals()) | set(__all__))
