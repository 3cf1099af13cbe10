"""tidal: a compiler-style graph transformation toolkit for PyTorch.

``tidal.compile(model, example_inputs, passes=..., cluster=...)`` traces a model with torch.fx,
annotates per-layer costs, runs graph passes that apply published parallelism and
data-movement techniques, and returns a ``Compiled`` model with ``report()``, ``plan`` and
``dump(dir)``.

Example:
    >>> import torch, tidal
    >>> model = torch.nn.Linear(4, 4)
    >>> x = torch.randn(2, 4)
    >>> torch.equal(tidal.compile(model, (x,))(x), model(x))
    True
"""
from tidal.compiler.api import compile  # noqa: A001  (the public name, shadowing the builtin)
from tidal.compiler.capture import capture_train_step, trace
from tidal.compiler.compiled import Compiled
from tidal.ir.cluster import Cluster
from tidal.ir.device_profile import DeviceProfile
from tidal.ir.errors import PassError, PlanError, TidalError, TraceError
from tidal.ir.pass_api import Executor, Pass, PassContext, PassResult
from tidal.ir.plan import CompiledPlan, Plan
from tidal import passes  # noqa: F401  (tidal.passes.registry(): the registered passes)
from tidal.runtime import ddp_hooks as hooks  # noqa: F401  (DDP communication hooks)

__version__ = "0.1.0"

__all__ = [
    "compile", "trace", "capture_train_step", "Compiled", "Cluster", "DeviceProfile",
    "Pass", "PassContext", "PassResult", "Executor", "Plan", "CompiledPlan", "passes", "hooks",
    "TidalError", "TraceError", "PassError", "PlanError", "__version__",
]
