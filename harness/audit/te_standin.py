"""Transformer Engine's parameter layout where Transformer Engine is not installed.

The real-shape audit's flag path (``scripts/audit_param_sync.py ... -- <pretrain_gpt.py
flags>``) builds the model with the layer spec the flags choose. Megatron's default,
``--transformer-impl transformer_engine``, builds the TE spec: ``TELayerNormColumnParallelLinear``
(LayerNorm fused into the next linear: ``layer_norm_weight`` [and ``layer_norm_bias``]
registered before ``weight``), ``TERowParallelLinear``, ``TENorm``, ``TEDotProductAttention`` and
the TE expert linears. Their names, registration order and shapes set DDP's buckets (params in
reverse registration order) and the layer-wise optimizer's shards (params sorted by numel,
ties in registration order), so the local spec is no stand-in for them: Llama-3-8B at DP 8
makes 629 zero-size NCCL operations with the local spec against 630 with TE's.

This module gives megatron its own TE wrappers (``megatron/core/extensions/transformer_engine.py``)
without TE: ``install()`` puts a ``transformer_engine`` package into ``sys.modules`` whose
``pytorch.Linear``, ``LayerNormLinear``, ``GroupedLinear``, ``LayerNorm``, ``RMSNorm`` and
``DotProductAttention`` register exactly the parameters TE's classes register (name, order,
shape, dtype, the tensor-parallel attributes of TE's ``reset_parameters``), and compute
nothing; then it re-executes megatron's TE extension and the spec modules that bind it
(``importlib.reload``), so that megatron's wrappers (their TP and expert splitting, their
``allreduce`` attributes) and megatron's spec functions run unchanged on top. Modules that
megatron imported before keep seeing no TE, so DDP, the optimizers and fp8 utilities take the
same code paths as without TE.

What TE does, as read from its source (``transformer_engine/pytorch/module/``), mirrored here:

* ``Linear(in_features, out_features, bias, parallel_mode, tp_size|tp_group, params_dtype)``:
  ``weight`` [out, in], then ``bias`` [out] when ``bias``; ``parallel_mode="column"`` divides
  out by the TP size, ``"row"`` divides in.
* ``LayerNormLinear``: ``layer_norm_weight`` [in], ``layer_norm_bias`` [in] unless
  ``normalization="RMSNorm"``, then as ``Linear`` (the LayerNorm params are not split).
* ``GroupedLinear(num_gemms, ...)``: per GEMM ``weight{i}`` [out, in] then ``bias{i}``
  (TE 1.9 to 2.13; TE >= 2.14 can pack them into one ``weight`` only when megatron asks for
  ``moe_single_grouped_weight``, which no flag of 0.17.1 or 0.19 sets by default).
* ``LayerNorm(normalized_shape)``: ``weight``, ``bias``; ``RMSNorm``: ``weight``.
* ``DotProductAttention``: no parameter (``softmax_type="vanilla"``, the default).

``TE_VERSION`` is the version megatron's gates see (``megatron.core.utils.get_te_version``).

Errors: ``install()`` raises ``RuntimeError`` when a real ``transformer_engine`` is importable
(use it instead) and lets ``ImportError`` from megatron's modules through.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types

import torch

#: What megatron's version gates see (TE 2.9: the TE spec as megatron 0.17.1 and 0.19 build it
#: by default, per-expert GroupedLinear weights).
TE_VERSION = "2.9.0"
#: The megatron modules that bind TE's classes or HAVE_TE when imported, in dependency order;
#: ``install()`` re-executes those already imported (the others import the stand-in anyway).
RELOAD = (
    "megatron.core.extensions.transformer_engine",
    "megatron.core.extensions.transformer_engine_spec_provider",
    "megatron.core.transformer.moe.experts",
    "megatron.core.models.gpt.moe_module_specs",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
    "megatron.core.models.gpt.gpt_layer_specs",
)


def _tp_size(tp_group, tp_size) -> int:
    if tp_group is not None and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(tp_group)
    return tp_size


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d


def _tp_attrs(t, is_parallel: bool, dim: int) -> None:
    """TE's ``set_tensor_model_parallel_attributes`` (the same three attributes as megatron's)."""
    t.tensor_model_parallel = is_parallel
    t.partition_dim = dim
    t.partition_stride = 1


class TransformerEngineBaseModule(torch.nn.Module):
    """What megatron's wrappers need of TE's ``TransformerEngineBaseModule``: construction
    (keyword arguments TE does not use here are accepted and ignored) and
    ``register_parameter`` with TE's extra keywords; no forward."""

    def __init__(self):
        super().__init__()
        self.fp8 = False
        self.fp8_meta = None

    def register_parameter(self, name, param, **_te_kwargs):  # init_fn, get_rng_state_tracker, ...
        super().register_parameter(name, param)

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group

    def forward(self, *args, **kwargs):
        raise RuntimeError("Transformer Engine stand-in: parameter layout only, no compute")


def _parallel_dims_of(module, in_features, out_features, tp_group, tp_size, parallel_mode, bias, sequence_parallel):
    """Set TE's tensor-parallel attributes of a Linear-like module: its group and size, this
    rank's in/out features (column: out split by TP; row: in split), bias and sequence
    parallelism, as TE's Linear and GroupedLinear do."""
    module.parallel_mode = parallel_mode
    module.tp_size = _tp_size(tp_group, tp_size)
    module.set_tensor_parallel_group(tp_group)
    module.in_features, module.out_features = in_features, out_features
    if parallel_mode == "column":
        module.out_features = _divide(out_features, module.tp_size, "out_features")
    elif parallel_mode == "row":
        module.in_features = _divide(in_features, module.tp_size, "in_features")
    module.use_bias = bias
    module.sequence_parallel = module.tp_size > 1 and sequence_parallel


class Linear(TransformerEngineBaseModule):
    """``transformer_engine.pytorch.Linear``'s parameters: ``weight`` [out, in] then ``bias``."""

    def __init__(self, in_features, out_features, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, init_method=None, bias=True,
                 return_bias=False, params_dtype=None, parallel_mode=None, device="cuda", **_kwargs):  # fmt: skip
        super().__init__()
        _parallel_dims_of(self, in_features, out_features, tp_group, tp_size, parallel_mode, bias, sequence_parallel)
        dtype = params_dtype or torch.get_default_dtype()
        self._linear_params(dtype, device)

    def _linear_params(self, dtype, device) -> None:
        self.register_parameter("weight", torch.nn.Parameter(
            torch.empty(self.out_features, self.in_features, device=device, dtype=dtype)))  # fmt: skip
        if self.use_bias:
            self.register_parameter("bias", torch.nn.Parameter(torch.empty(self.out_features, device=device, dtype=dtype)))
        else:
            self.bias = torch.Tensor().to(dtype=dtype, device=device)
        _tp_attrs(self.weight, True, 1 if self.parallel_mode == "row" else 0)
        if self.use_bias:
            if self.parallel_mode == "row":
                self.bias.sequence_parallel = self.sequence_parallel
            elif self.parallel_mode == "column":
                _tp_attrs(self.bias, True, 0)


class LayerNormLinear(Linear):
    """``transformer_engine.pytorch.LayerNormLinear``'s parameters: ``layer_norm_weight``,
    ``layer_norm_bias`` (LayerNorm only), then ``Linear``'s."""

    def __init__(self, in_features, out_features, eps=1e-5, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, init_method=None, bias=True,
                 normalization="LayerNorm", return_bias=False, params_dtype=None, parallel_mode=None,
                 device="cuda", **_kwargs):  # fmt: skip
        TransformerEngineBaseModule.__init__(self)
        _parallel_dims_of(self, in_features, out_features, tp_group, tp_size, parallel_mode, bias, sequence_parallel)
        self.normalization = normalization
        dtype = params_dtype or torch.get_default_dtype()
        self.register_parameter("layer_norm_weight", torch.nn.Parameter(torch.empty(in_features, device=device, dtype=dtype)))
        self.layer_norm_weight.sequence_parallel = self.sequence_parallel
        if normalization != "RMSNorm":
            self.register_parameter("layer_norm_bias", torch.nn.Parameter(torch.empty(in_features, device=device, dtype=dtype)))
            self.layer_norm_bias.sequence_parallel = self.sequence_parallel
        else:
            self.layer_norm_bias = None
        self._linear_params(dtype, device)


class GroupedLinear(TransformerEngineBaseModule):
    """``transformer_engine.pytorch.GroupedLinear``'s parameters: per GEMM ``weight{i}``, then
    ``bias{i}`` when ``bias``."""

    def __init__(self, num_gemms, in_features, out_features, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, rng_tracker_name=None, init_method=None,
                 bias=True, return_bias=False, params_dtype=None, parallel_mode=None, device="cuda", **_kwargs):  # fmt: skip
        super().__init__()
        self.num_gemms = num_gemms
        _parallel_dims_of(self, in_features, out_features, tp_group, tp_size, parallel_mode, bias, sequence_parallel)
        dtype = params_dtype or torch.get_default_dtype()
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(self.out_features, self.in_features, device=device, dtype=dtype))
            self.register_parameter(f"weight{i}", w)
            _tp_attrs(w, True, 1 if parallel_mode == "row" else 0)
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.empty(self.out_features, device=device, dtype=dtype)))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=dtype, device=device))


class _Norm(TransformerEngineBaseModule):
    def __init__(self, normalized_shape, eps=1e-5, sequence_parallel=False, params_dtype=None, zero_centered_gamma=False,
                 device="cuda", **_kwargs):  # fmt: skip
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        dtype = params_dtype or torch.get_default_dtype()
        self.register_parameter("weight", torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
        self.weight.sequence_parallel = sequence_parallel
        if self._has_bias:
            self.register_parameter("bias", torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
            self.bias.sequence_parallel = sequence_parallel


class LayerNorm(_Norm):
    """``transformer_engine.pytorch.LayerNorm``'s parameters: ``weight``, ``bias``."""

    _has_bias = True


class RMSNorm(_Norm):
    """``transformer_engine.pytorch.RMSNorm``'s parameter: ``weight``."""

    _has_bias = False


class DotProductAttention(TransformerEngineBaseModule):
    """``transformer_engine.pytorch.DotProductAttention``: no parameter (vanilla softmax)."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        if kwargs.get("softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError("Transformer Engine stand-in: only softmax_type='vanilla' (no parameter)")


class _FP8GlobalStateManager:
    @staticmethod
    def is_fp8_enabled():
        return False

    @staticmethod
    def with_fp8_parameters():
        return False


class _Placeholder:
    """A TE class megatron subclasses at import but the audit never constructs."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("Transformer Engine stand-in: not available")


def _any_name(name: str):
    """Module ``__getattr__`` of the stand-in's namespaces of kernels: every public name is a
    ``_Placeholder``; dunder names (``__file__``, ...) do not exist, as on a plain module."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder


def _modules() -> dict:
    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__path__ = []  # a package: `import transformer_engine.pytorch.x` raises ModuleNotFoundError
        return m

    fp8 = mod("transformer_engine.pytorch.fp8", FP8GlobalStateManager=_FP8GlobalStateManager,
              fp8_autocast=lambda *a, **k: contextlib.nullcontext(),
              fp8_model_init=lambda *a, **k: contextlib.nullcontext())  # fmt: skip
    distributed = mod("transformer_engine.pytorch.distributed", CudaRNGStatesTracker=_Placeholder)
    # te.pytorch.ops (fusible operations): megatron names them in annotations and in modules
    # the audit does not build (TEFusedMLP, TEActivationOp, fused residual RMSNorm).
    ops = mod("transformer_engine.pytorch.ops", __getattr__=_any_name)
    # te.pytorch.router: fused MoE routing kernels (--moe-router-fusion), imported by name.
    router = mod("transformer_engine.pytorch.router", __getattr__=_any_name)
    pytorch = mod("transformer_engine.pytorch", Linear=Linear, LayerNormLinear=LayerNormLinear,
                  GroupedLinear=GroupedLinear, LayerNorm=LayerNorm, RMSNorm=RMSNorm,
                  DotProductAttention=DotProductAttention, fp8=fp8, distributed=distributed, ops=ops, router=router,
                  fp8_autocast=fp8.fp8_autocast)  # fmt: skip
    recipe = mod("transformer_engine.common.recipe", DelayedScaling=_Placeholder)
    common = mod("transformer_engine.common", recipe=recipe)
    te = mod("transformer_engine", pytorch=pytorch, common=common, __version__=TE_VERSION,
             AUDIT_STANDIN=True)  # fmt: skip
    return {m.__name__: m for m in (te, pytorch, fp8, distributed, ops, router, common, recipe)}


def te_installed() -> bool:
    """Whether a real Transformer Engine is importable (then megatron uses it as it is)."""
    te = sys.modules.get("transformer_engine")
    if te is not None:
        return not getattr(te, "AUDIT_STANDIN", False)
    return importlib.util.find_spec("transformer_engine") is not None


def install() -> None:
    """Put the stand-in ``transformer_engine`` into ``sys.modules`` and re-execute megatron's
    TE extension and TE spec modules (``RELOAD``) on it; resets megatron's cached TE version.

    Raises:
        RuntimeError: a real Transformer Engine is importable.
        ImportError / AttributeError: megatron's TE extension needs a TE name the stand-in
            lacks (this megatron release is then not supported by the stand-in).
    """
    if te_installed():
        raise RuntimeError("Transformer Engine is installed; the stand-in is for machines without it")
    sys.modules.update(_modules())
    import megatron.core.utils as mcu

    mcu._te_version = None
    for name in RELOAD:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
        else:
            with contextlib.suppress(ModuleNotFoundError):
                importlib.import_module(name)
    from megatron.core.extensions import transformer_engine as ext

    if not ext.HAVE_TE:
        raise ImportError("megatron's Transformer Engine extension did not take the stand-in")
