"""Transformer Engine path: TE's modules driven by miniTE's aligned quantizers.

With TE >= 2.16, Megatron's TE spec can run a ``CustomRecipe(qfactory=...)`` instead of
``NVFP4BlockScaling``::

    --transformer-impl transformer_engine --fp4-format e2m1 --fp4-recipe custom \\
        --fp4-quantizer-factory minite_megatron.te.quantizer_factory.qfactory

TE asks the factory for one quantizer per GEMM operand role and routes every GEMM on the
resulting custom tensors to the quantizer's ``qgemm``. miniTE's quantizers apply the recipe's
aligned scheme (per-token activation scales, 16x16 weight tiles whose transpose is exact, SR and
RHT for gradients) and compute the GEMMs through the same NVFP4 backends as the minite specs,
so a TE-built model and a minite-built model run the same contract.

The recipe is :class:`~minite_megatron.recipe.Recipe` (``MINITE_RECIPE`` may hold its JSON, or
call :func:`make_qfactory` with one). Without Transformer Engine this module still imports;
every entry point then raises :class:`TransformerEngineUnavailable` saying why.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from .. import nvfp4
from ..nvfp4.tensor import NVFP4Tensor
from ..ops.roles import gemm_role, quantize_role
from ..recipe import Recipe
from ..settings import settings

try:  # TE >= 2.16: custom recipes with role-aware quantizer factories
    from transformer_engine.pytorch.custom_recipes import quantization as _te_quantization
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage, Quantizer

    _TE_ERROR: Exception | None = None
except Exception as e:  # ImportError, or a TE build that fails to load without a GPU
    QuantizedTensorStorage = object  # type: ignore[assignment,misc]
    Quantizer = object  # type: ignore[assignment,misc]
    _te_quantization = None
    _TE_ERROR = e


class TransformerEngineUnavailable(RuntimeError):
    """The TE path was requested but Transformer Engine (>= 2.16) cannot be imported here."""


def te_why_not() -> str | None:
    """None if the TE path can run here, else the reason."""
    if _TE_ERROR is not None:
        return (
            f"Transformer Engine >= 2.16 is required for --fp4-recipe custom with miniTE's quantizer "
            f"factory, but it cannot be imported: {type(_TE_ERROR).__name__}: {_TE_ERROR} "
            "(install the [te] extra on a CUDA machine)"
        )
    return None


def require_te() -> None:
    reason = te_why_not()
    if reason is not None:
        raise TransformerEngineUnavailable(reason)


# ---- roles ----------------------------------------------------------------------------------------
_STRING_ROLES = {"linear_input": "input", "linear_weight": "weight", "linear_grad_output": "grad_output"}


def role_kind(role: Any) -> str | None:
    """TE's role (a ``QuantizerRole`` with ``tensor_type``, or an older string) -> our kind.

    Only GEMM operands are quantized: ``input``, ``weight``, ``grad_output``; outputs and input
    gradients stay in high precision (None).
    """
    if role is None:
        return None
    if isinstance(role, str):
        return _STRING_ROLES.get(role)
    kind = getattr(role, "tensor_type", None)
    return kind if kind in ("input", "weight", "grad_output") else None


#: TE's operand kind -> (the role of its rowwise form, the role of its columnwise form)
TE_ROLES = {
    "weight": (("fprop", "weight"), ("dgrad", "weight")),
    "input": (("fprop", "input"), ("wgrad", "input")),
    "grad_output": (("dgrad", "grad"), ("wgrad", "grad")),
}


def quantize_operand(x: torch.Tensor, kind: str, recipe: Recipe, rowwise: bool, columnwise: bool, *,
                     tp_group=None, parallel_mode: str | None = None):
    """The rowwise (GEMM K = last dim) and columnwise (K = tokens, for wgrad) NVFP4 forms of an
    operand of ``kind`` under ``recipe``: the roles of :data:`TE_ROLES` in the minite modules'
    table (:mod:`minite_megatron.ops.roles`: TP amax sync over ``tp_group`` under
    ``parallel_mode``, tokens padded to 16 for wgrad), so exactly what the minite modules compute."""
    x2 = x.reshape(-1, x.shape[-1])
    backend = nvfp4.get_backend(recipe.backend, x.device)
    (row_gemm, row_op), (col_gemm, col_op) = TE_ROLES[kind]
    tp = dict(tp_group=tp_group, parallel_mode=parallel_mode)
    row = col = None
    if rowwise or kind == "weight":  # the weight's columnwise form is its rowwise one relaid out
        row = quantize_role(gemm_role(recipe, row_gemm, row_op), x2, recipe, backend, **tp)
    if columnwise:
        col = quantize_role(gemm_role(recipe, col_gemm, col_op), x2, recipe, backend, fprop_weight=row, **tp)
    return (row if rowwise else None), col


@dataclasses.dataclass
class MiniteTETensor(QuantizedTensorStorage):
    """TE's view of a miniTE operand: the rowwise and columnwise :class:`NVFP4Tensor` forms.

    ``data``/``scale`` and ``data_t``/``scale_t`` expose the packed codes and linear E4M3 scales
    the way TE's custom GEMM dispatch reads them.
    """

    row: NVFP4Tensor | None = None
    col: NVFP4Tensor | None = None
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    original_shape: tuple[int, ...] | None = None
    _quantizer: Any = None

    @property
    def custom(self) -> bool:
        return True

    @property
    def data(self):
        return None if self.row is None else self.row.codes

    @property
    def scale(self):
        return None if self.row is None else self.row.linear_scales()

    @property
    def data_t(self):
        return None if self.col is None else self.col.codes

    @property
    def scale_t(self):
        return None if self.col is None else self.col.linear_scales()

    def prepare_for_saving(self):
        """TE's protocol: the forms' tensors for ``save_for_backward``, and self without them."""
        tensors, self._saved = [], []
        for q in (self.row, self.col):
            t, meta = q.prepare_for_saving() if q is not None else ([], None)
            tensors += t
            self._saved.append((meta, len(t)))
        self.row = self.col = None
        return tensors, self

    def restore_from_saved(self, tensors):
        """Put back what :meth:`prepare_for_saving` took; returns the tensors left over."""
        (row_meta, n_row), (col_meta, n_col) = self._saved
        self.row = None if row_meta is None else row_meta.restore_from_saved(tensors[:n_row])
        self.col = None if col_meta is None else col_meta.restore_from_saved(tensors[n_row:n_row + n_col])
        return tensors[n_row + n_col:]

    def update_usage(self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None):
        if columnwise_usage and self.col is None:
            if self.row is not None and self.row.tile == (16, 16):
                self.col = self.row.transpose()  # exact for 16x16 tiles
            else:
                raise RuntimeError("miniTE: a columnwise operand must be quantized from the high-precision tensor")
        if rowwise_usage is False:
            self.row = None
        if columnwise_usage is False:
            self.col = None

    def size(self, *args, **kwargs):
        return torch.Size(self.original_shape)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        q = self.row if self.row is not None else self.col.transpose()
        return q.dequantize(dtype or self.dtype).reshape(self.original_shape)


class MiniteTEQuantizer(Quantizer):
    """One TE quantizer per operand role, applying miniTE's recipe and GEMM."""

    def __init__(self, kind: str, recipe: Recipe, rowwise: bool = True, columnwise: bool = True, *,
                 tp_group=None, parallel_mode: str | None = None):
        require_te()
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.internal = True
        self.kind = kind
        self.recipe = recipe
        self.tp_group, self.parallel_mode = tp_group, parallel_mode

    @property
    def custom(self) -> bool:
        return True

    def quantize(self, tensor: torch.Tensor, **kwargs) -> MiniteTETensor:
        row, col = quantize_operand(tensor, self.kind, self.recipe, self.rowwise_usage, self.columnwise_usage,
                                    tp_group=self.tp_group, parallel_mode=self.parallel_mode)
        return MiniteTETensor(row=row, col=col, dtype=tensor.dtype, device=tensor.device,
                              original_shape=tuple(tensor.shape), _quantizer=self)

    def update_quantized(self, src: torch.Tensor, dst: MiniteTETensor, *, noop_flag=None) -> MiniteTETensor:
        if noop_flag is not None and noop_flag.item() != 0:
            return dst
        fresh = self.quantize(src)
        dst.row, dst.col, dst.dtype, dst.original_shape = fresh.row, fresh.col, fresh.dtype, fresh.original_shape
        return dst

    @property
    def supports_allgather_fp8(self) -> bool:
        return False

    @property
    def supports_dequantize(self) -> bool:
        return True

    def qgemm(self, qx, qw, m_params, out_dtype, sx, sw, bias=None, out=None, accumulate=False,
              gemm_type=None, qresult_x: MiniteTETensor | None = None, qresult_w: MiniteTETensor | None = None):
        """FPROP ``x @ W^T``, DGRAD ``dy @ W`` (W^T exact), WGRAD ``dy^T @ x`` (both along tokens)."""
        kinds = _te_quantization.GEMMType
        strict = self.recipe.strict
        backend = nvfp4.get_backend(self.recipe.backend, qresult_x.device)
        if gemm_type == kinds.WGRAD:
            result = backend.gemm(qresult_x.col, qresult_w.col, None, torch.float32, strict)
        elif gemm_type == kinds.DGRAD:
            result = backend.gemm(qresult_x.row, qresult_w.col, None, out_dtype, strict)
        else:
            result = backend.gemm(qresult_x.row, qresult_w.row, bias, out_dtype, strict)
        if accumulate and out is not None:
            out.add_(result.to(out.dtype))
            return out
        return result.to(out_dtype) if out_dtype is not None else result


def _recipe_from_env() -> Recipe:
    text = settings().recipe_json
    return Recipe.from_dict(json.loads(text)) if text else Recipe()


def make_qfactory(recipe: Recipe | None = None):
    """A TE quantizer factory for ``CustomRecipe(qfactory=...)`` applying ``recipe``."""
    require_te()
    recipe = recipe if recipe is not None else _recipe_from_env()

    def factory(role):
        kind = role_kind(role)
        return None if kind is None else MiniteTEQuantizer(kind, recipe)

    return factory


def qfactory(role):
    """The default factory (``--fp4-quantizer-factory minite_megatron.te.quantizer_factory.qfactory``);
    its recipe comes from ``MINITE_RECIPE`` (JSON) or the defaults."""
    require_te()
    kind = role_kind(role)
    return None if kind is None else MiniteTEQuantizer(kind, _recipe_from_env())
