"""No compilation on CPU: ``torch.compile`` is the identity and megatron builds nothing.

* ``compile_passthrough`` replaces ``torch.compile`` (also as ``@torch.compile(...)``), and
  ``torch._dynamo.config.disable`` is set. ``core/jit.py`` binds ``jit_fuser =
  torch.compile`` at import, so the compiled fusions (bias-gelu, swiglu, ...) run eagerly
  and bitwise repeatably.
* ``megatron.core.datasets.utils.compile_helpers`` becomes a no-op:
  ``training/initialize.py:_compile_dependencies`` runs ``make`` in the dataset folder, but
  the wheel ships the prebuilt ``helpers_cpp`` and the tree may be read-only.
"""

from __future__ import annotations

from typing import Any


def compile_passthrough(model: Any = None, **kwargs):
    """``torch.compile`` stand-in: returns ``model`` unchanged, or an identity decorator."""
    if model is None:
        return lambda fn: fn
    return model
