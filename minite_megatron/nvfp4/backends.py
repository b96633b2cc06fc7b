"""Backends that implement the contract, and the dispatcher that picks one.

A backend subclasses :class:`Backend`: ``available(device) -> bool``, ``why_not(device) -> str |
None`` (the reason it cannot run there), every op of :data:`OPS` with the reference's signature
(an op it does not run raises :class:`OpNotSupported` with the reason) and
``supports(op, **shape) -> str | None``, the question callers ask before a fused path.
``get_backend(None, device)`` picks the best available one for the device:
``blackwell`` (sm_100a/sm_103a FP4 tensor cores) > ``triton`` (any CUDA GPU) > ``reference``
(pure torch, always available). ``MINITE_BACKEND=<name>`` (:mod:`minite_megatron.settings`) overrides the choice.

Kernel backends live in the ``minite_kernels`` package and are imported lazily, so this
package imports only torch.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Sequence

import torch

from .gemm import gemm_reference
from .grouped import decode_grouped_gemm_reference, grouped_gemm_reference, grouped_wgrad_gemm_reference, grouped_wgrad_reference
from . import moe_reference as _moe
from .quantize import quantize_reference
from .tensor import NVFP4Tensor
from ..settings import settings


def triton_interpreting() -> bool:
    """Does Triton run kernels in its interpreter (CPU tensors; ``TRITON_INTERPRET``,
    :mod:`minite_megatron.settings`)? Read without importing Triton, once: the launchers ask on
    every launch (~600 times a learner step). Code that sets the variable after the first call
    calls ``settings.cache_clear()`` (or ``triton_interpreting.cache_clear()``, the same)."""
    return settings().triton_interpret


triton_interpreting.cache_clear = settings.cache_clear


class BackendUnavailable(RuntimeError):
    """A backend was asked for where it cannot run; the message says why."""


class OpNotSupported(NotImplementedError):
    """A backend was asked for an op (or an operand shape) it does not run; the message says why."""


#: The batch-invariant ops of strict mode (a row's result independent of the batch, prefill equal to
#: decode): a kernel's only; their references are the contract's torch formulations in
#: :mod:`minite_megatron.invariant`, which its callers run where :meth:`Backend.supports` gives a reason.
INVARIANT_OPS = ("bi_matmul", "bi_rmsnorm", "bi_rmsnorm_backward", "bi_log_softmax", "bi_attention")

#: Every op a backend may run. ``quantize``, ``gemm``, ``grouped_gemm``, ``grouped_wgrad`` and
#: ``grouped_wgrad_gemm`` (the base class runs the contract's on the backend's device) are
#: always there; the others are fused or relayout-free paths whose callers take the contract's
#: composition where :meth:`Backend.supports` gives a reason.
OPS = (
    "quantize", "gemm", "gemm_nt", "grouped_gemm", "grouped_gemm_nt", "grouped_wgrad", "grouped_wgrad_gemm",
    "quantize_wgrad_operand", "dy_amaxes", "decode_grouped_gemm", "rmsnorm_quantize", "swiglu_quantize",
    *("weighted_swiglu", "weighted_swiglu_backward", "deterministic_unpermute", "ordered_sum", "zero_empty_groups",
      "moe_route", "moe_sum_rows", "add_rmsnorm_quantize", "qk_norm_rope_cache"),
    *INVARIANT_OPS,
)

#: The ops whose base implementation is the contract's reference (:mod:`.moe_reference`) on the
#: operands' device: calling them is always right; ``supports`` says whether a kernel runs.
REFERENCE_OPS = ("weighted_swiglu", "weighted_swiglu_backward", "deterministic_unpermute", "ordered_sum",
                 "zero_empty_groups", "moe_sum_rows", "grouped_wgrad_gemm")


#: The ops that take group sizes (``supports(op, device_sizes=True)``: may they stay on the device?).
GROUPED_OPS = ("grouped_gemm", "grouped_gemm_nt", "grouped_wgrad", "grouped_wgrad_gemm", "quantize_wgrad_operand",
               "dy_amaxes")


class Backend:
    """Base class of the NVFP4 backends: every op with the reference's signature.

    A subclass overrides the ops it runs; the others raise :class:`OpNotSupported`
    ("<backend> does not support <op>: <why>"). :meth:`supports` answers, without running
    anything, whether an op runs for given operand facts (``supports(op, **shape) -> None`` or
    the reason), so callers choose a fused path by asking, never by ``hasattr``.
    """

    name = "backend"
    #: Do its grouped ops take a :class:`~.group_sizes.DeviceGroupSizes` (counts left on the device)?
    #: Asked through ``supports(op, device_sizes=True)``.
    device_group_sizes = False

    def why_not(self, device: torch.device | str | None = None) -> str | None:
        """None if the backend runs on ``device``, else the reason."""
        return None

    def available(self, device: torch.device | str | None = None) -> bool:
        return self.why_not(device) is None

    def supports(self, op: str, **shape) -> str | None:
        """None if ``op`` runs here for operands described by ``shape`` (``tile=``, ``dtype=``,
        ``width=``, ``global_scale=``, ``device_sizes=`` (group sizes as a ``DeviceGroupSizes``), as
        the op's callers pass them), else why not. Raises
        ValueError for an unknown op name. Subclasses add their own limits after this check."""
        if op not in OPS:
            raise ValueError(f"unknown NVFP4 backend op {op!r}; known: {', '.join(OPS)}")
        if getattr(type(self), op) is getattr(Backend, op):
            if op == "grouped_wgrad_gemm":
                return None
            if op in REFERENCE_OPS:
                return f"the {self.name} backend has no {op} kernel: the contract's reference runs"
            if op in INVARIANT_OPS:
                return f"the {self.name} backend has no {op} kernel: the torch formulation (minite_megatron.invariant) runs"
            return f"the {self.name} backend has no {op} kernel"
        if shape.get("device_sizes") and op in GROUPED_OPS and not self.device_group_sizes:
            return f"the {self.name} backend's {op} takes host group sizes, not counts left on the device"
        return None

    # ---- the batch-invariant ops (:data:`INVARIANT_OPS`; base: refused, the caller runs the torch formulation) ----
    def bi_matmul(self, x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
        """``x2d @ weight.T (+ bias)`` ``[M, N]`` in ``out_dtype``, a row independent of M (fixed tiles, K in
        order, no split-K): ``invariant.matmul.linear_torch``'s contract, another fixed order."""
        self._refuse("bi_matmul")

    def bi_rmsnorm(self, x2d: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
        """RMSNorm of each row ``[M, H]`` in ``x2d.dtype``, one fixed reduction per row:
        ``invariant.rmsnorm.rms_norm_torch``'s contract."""
        self._refuse("bi_rmsnorm")

    def bi_rmsnorm_backward(self, gy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, eps: float,
                            zero_centered_gamma: bool, weight_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(dx, dweight or None)`` of the RMSNorm in one pass (``supports(op, width=H)``):
        ``invariant.rmsnorm.rms_norm_backward_torch``'s formulas, sums in another fixed order."""
        self._refuse("bi_rmsnorm_backward")

    def bi_log_softmax(self, x2d: torch.Tensor) -> torch.Tensor:
        """fp32 log-softmax of each row ``[M, V]``, a fixed order per row: ``invariant.softmax.log_softmax_torch``'s contract."""
        self._refuse("bi_log_softmax")

    def bi_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     causal: bool, return_lse: bool = False):
        """fp32 ``[B, Hq, Sq, Dv]`` attention, one fixed KV-block order for prefill and decode (with
        ``return_lse``: and the fp32 ``[B, Hq, Sq]`` log-sum-exp): ``invariant.attention.attention_torch``'s contract."""
        self._refuse("bi_attention")

    def _refuse(self, op: str, why: str | None = None):
        raise OpNotSupported(f"{self.name} does not support {op}: {why or self.supports(op)}")

    def quantize(self, x: torch.Tensor, **kwargs) -> NVFP4Tensor:
        """:func:`~.quantize.quantize_reference`'s signature and bits."""
        self._refuse("quantize")

    def gemm(self, a: NVFP4Tensor, b: NVFP4Tensor, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.bfloat16, batch_invariant: bool = False) -> torch.Tensor:
        """``a @ b.T``: :func:`~.gemm.gemm_reference`."""
        self._refuse("gemm")

    def gemm_nt(self, a: NVFP4Tensor, b: NVFP4Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.bfloat16, batch_invariant: bool = False) -> torch.Tensor:
        """``a @ b`` for ``b`` ``[N, K]`` with 16x16 tiles: ``gemm(a, b.transpose())`` bit for bit."""
        self._refuse("gemm_nt")

    def grouped_gemm(self, a: NVFP4Tensor, b: NVFP4Tensor, group_sizes: Sequence[int], bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16, batch_invariant: bool = False) -> torch.Tensor:
        """MoE fprop/dgrad: :func:`~.grouped.grouped_gemm_reference`."""
        self._refuse("grouped_gemm")

    def grouped_gemm_nt(self, a: NVFP4Tensor, b: NVFP4Tensor, group_sizes: Sequence[int],
                        bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                        batch_invariant: bool = False) -> torch.Tensor:
        """``grouped_gemm(a, b.transpose())`` bit for bit, ``b`` ``[G, N, K]`` with 16x16 tiles."""
        self._refuse("grouped_gemm_nt")

    def grouped_wgrad(self, grad_out: torch.Tensor, x: torch.Tensor, group_sizes: Sequence[int], **kwargs) -> torch.Tensor:
        """MoE wgrad: :func:`~.grouped.grouped_wgrad_reference`."""
        self._refuse("grouped_wgrad")

    def grouped_wgrad_gemm(self, a: NVFP4Tensor, b: NVFP4Tensor, padded_group_sizes: Sequence[int],
                           out_dtype: torch.dtype = torch.float32, batch_invariant: bool = False) -> torch.Tensor:
        """The GEMM half of the MoE wgrad on operands quantized along padded tokens; by default
        the contract's (:func:`~.grouped.grouped_wgrad_gemm_reference`) on the operands' device."""
        return grouped_wgrad_gemm_reference(a, b, padded_group_sizes, out_dtype)

    def quantize_wgrad_operand(self, t: torch.Tensor, group_sizes: Sequence[int], **kwargs) -> NVFP4Tensor:
        """:func:`~.grouped.quantize_wgrad_operand` read in place (no padded copy)."""
        self._refuse("quantize_wgrad_operand")

    def dy_amaxes(self, dy: torch.Tensor, group_sizes: Sequence[int], rht_seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A gradient's two tensor-scale amaxes from one read: ``(amax of dy, amax of
        quantize_wgrad_operand's padded, transformed operand)``, fp32 ``[1]`` each."""
        self._refuse("dy_amaxes")

    def decode_grouped_gemm(self, a: NVFP4Tensor, w_stacked: NVFP4Tensor, expert_ids: torch.Tensor,
                            out_dtype: torch.dtype = torch.bfloat16, batch_invariant: bool = False, *,
                            num_experts: int | None = None, group_offsets: torch.Tensor | None = None,
                            a_rows: torch.Tensor | None = None) -> torch.Tensor:
        """MoE decode on unsorted rows: :func:`~.grouped.decode_grouped_gemm_reference`
        (``group_offsets``: rows already sorted by expert, ``[E + 1]`` prefix offsets; ``a_rows``:
        product row ``r`` takes row ``a_rows[r]`` of ``a``). ``supports("decode_grouped_gemm",
        a_rows=True, ...)`` says whether a kernel reads the rows by index (else they are gathered)."""
        self._refuse("decode_grouped_gemm")

    def rmsnorm_quantize(self, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
                         zero_centered_gamma: bool = False, **kwargs) -> tuple[torch.Tensor, NVFP4Tensor]:
        """RMSNorm and the per-token NVFP4 of its output: :func:`~.producers.rmsnorm_quantize_reference`."""
        self._refuse("rmsnorm_quantize")

    def swiglu_quantize(self, h: torch.Tensor, **kwargs) -> tuple[torch.Tensor, NVFP4Tensor]:
        """SwiGLU and the per-token NVFP4 of it: :func:`~.producers.swiglu_quantize_reference`."""
        self._refuse("swiglu_quantize")


    # ---- MoE ops without quantization (base: the contract's reference, :mod:`.moe_reference`) ----
    def weighted_swiglu(self, h: torch.Tensor, probs: torch.Tensor, *, inline_glu: bool = False) -> torch.Tensor:
        """``silu(gate) * up * probs[:, None]`` in ``h.dtype``: :func:`~.moe_reference.weighted_swiglu_reference`
        (``inline_glu``: the gate and up halves interleaved per 16 columns, a kernel's layout only)."""
        if inline_glu:
            self._refuse("weighted_swiglu", "the inline-GLU layout is a kernel's, not the reference's")
        return _moe.weighted_swiglu_reference(h, probs)

    def weighted_swiglu_backward(self, dy: torch.Tensor, h: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dh, dp)``: :func:`~.moe_reference.weighted_swiglu_backward_reference`."""
        return _moe.weighted_swiglu_backward_reference(dy, h, probs)

    def deterministic_unpermute(self, permuted: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """:func:`~.moe_reference.deterministic_unpermute_reference`."""
        return _moe.deterministic_unpermute_reference(permuted, sorted_indices, num_tokens)

    def ordered_sum(self, rows: torch.Tensor) -> torch.Tensor:
        """:func:`~.moe_reference.ordered_sum_reference`."""
        return _moe.ordered_sum_reference(rows)

    def moe_sum_rows(self, rows: torch.Tensor, combine: torch.Tensor, k: int) -> torch.Tensor:
        """``[T * k, H]`` expert-major rows -> ``[T, H]``, token ``t``'s rows at ``combine[t * k:(t + 1) * k]``
        added in that order from ``+0``: :func:`~.moe_reference.ordered_sum_reference` of the gathered rows."""
        t = combine.numel() // k
        return _moe.ordered_sum_reference(rows.index_select(0, combine.long()).view(t, k, rows.shape[-1]))

    def zero_empty_groups(self, out: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``out[g] = +0`` where ``counts[g] == 0``, in place: :func:`~.moe_reference.zero_empty_groups_reference`."""
        return _moe.zero_empty_groups_reference(out, counts)

    def moe_route(self, logits: torch.Tensor, k: int, scaling_factor: float | None = None) -> "_moe.Route":
        """A decode step's routing (softmax after the top-k) as a :class:`~.moe_reference.Route`; the
        reference is the learner's router (``rollout.fused_ops.moe_route_reference``)."""
        self._refuse("moe_route")

    def add_rmsnorm_quantize(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                             zero_centered_gamma: bool = False, **kwargs):
        """``h = residual + x``, ``y = rmsnorm(h)`` and the per-token NVFP4 of ``y`` in one pass."""
        self._refuse("add_rmsnorm_quantize")

    def qk_norm_rope_cache(self, mixed: torch.Tensor, wq, wk, eps: float, zero_centered_gamma: bool, cos, sin,
                           positions, k_cache, v_cache, groups: int, heads_per_group: int) -> torch.Tensor:
        """The decode step's q/k RMSNorm + RoPE + KV-cache write of all heads; returns q."""
        self._refuse("qk_norm_rope_cache")


def kernel_backend(device: torch.device | str, kernels_on_cpu: bool = False) -> Backend:
    """The backend for recipe-less ops (MoE combine, routing, the decode step's fusions) on
    ``device``: :func:`get_backend` ``(None, device)``; ``kernels_on_cpu`` (tests) takes the Triton
    backend for CPU tensors under ``TRITON_INTERPRET=1``."""
    device = torch.device(device)
    if kernels_on_cpu and device.type == "cpu" and triton_interpreting():
        return get_backend("triton", device)
    return get_backend(None, device)


class ReferenceBackend(Backend):
    """The contract itself: pure torch, any device, exact and batch invariant (slow)."""

    name = "reference"

    def quantize(self, x: torch.Tensor, **kwargs) -> NVFP4Tensor:
        return quantize_reference(x, **kwargs)

    def gemm(self, a, b, bias=None, out_dtype=torch.bfloat16, batch_invariant=False):
        return gemm_reference(a, b, bias, out_dtype)

    def grouped_gemm(self, a, b, group_sizes, bias=None, out_dtype=torch.bfloat16, batch_invariant=False):
        return grouped_gemm_reference(a, b, group_sizes, bias, out_dtype)

    def grouped_wgrad(self, grad_out, x, group_sizes, **kwargs):
        return grouped_wgrad_reference(grad_out, x, group_sizes, **kwargs)

    def decode_grouped_gemm(self, a, w_stacked, expert_ids, out_dtype=torch.bfloat16, batch_invariant=False, *,
                            num_experts=None, group_offsets=None, a_rows=None):
        # group_offsets (rows already sorted by expert) changes nothing here: every row is its own GEMM
        return decode_grouped_gemm_reference(a, w_stacked, expert_ids, out_dtype, batch_invariant,
                                             num_experts=num_experts, a_rows=a_rows)


# name -> "module:attribute" of a lazily imported backend object
_LAZY = {
    "triton": "minite_kernels.triton.backend:BACKEND",
    "blackwell": "minite_kernels.cute.backend:BACKEND",
}
_REGISTRY: dict[str, Backend] = {"reference": ReferenceBackend()}
_PREFERENCE = ("blackwell", "triton", "reference")


class _Missing(Backend):
    """Stand-in for a backend whose module cannot be imported here."""

    def __init__(self, name: str, error: Exception):
        self.name = name
        self._error = error

    def why_not(self, device=None) -> str:
        return f"backend {self.name!r} cannot be imported: {type(self._error).__name__}: {self._error}"


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY) + tuple(n for n in _LAZY if n not in _REGISTRY)


def _load(name: str) -> Backend:
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name not in _LAZY:
        raise ValueError(f"unknown NVFP4 backend {name!r}; known: {', '.join(backend_names())}")
    module, attr = _LAZY[name].split(":")
    try:
        backend = getattr(importlib.import_module(module), attr)
    except Exception as e:  # an optional dependency is missing or broken: say so, don't hide it
        backend = _Missing(name, e)
    _REGISTRY[name] = backend
    return backend


def register_backend(backend: Backend) -> None:
    """Add or replace a backend (e.g. a user's own kernels)."""
    _REGISTRY[backend.name] = backend


@contextlib.contextmanager
def registered(backend: Backend):
    """``backend`` registered under its name for the ``with`` block, the previous entry put back
    after (benchmarks and tests that compare a backend's options)."""
    previous = _REGISTRY.get(backend.name)
    _REGISTRY[backend.name] = backend
    try:
        yield backend
    finally:
        if previous is None:
            _REGISTRY.pop(backend.name, None)
        else:
            _REGISTRY[backend.name] = previous


def get_backend(name: str | None = None, device: torch.device | str | None = None) -> Backend:
    """The backend ``name`` (raising :class:`BackendUnavailable` with its reason if it cannot
    run on ``device``), or the best available one for ``device`` when ``name`` is None."""
    device = torch.device(device) if device is not None else None
    name = name or None
    if name is None and settings().backend is not None:
        name = settings().backend
        if name not in backend_names():
            raise ValueError(f"MINITE_BACKEND={name!r}: unknown NVFP4 backend; known: {', '.join(backend_names())}")
    if name is not None:
        backend = _load(name)
        if not backend.available(device):
            raise BackendUnavailable(f"NVFP4 backend {name!r} unavailable on {device}: {backend.why_not(device)}")
        return backend
    if device is None or device.type == "cpu":
        return _REGISTRY["reference"]
    for candidate in _PREFERENCE:
        backend = _load(candidate)
        if backend.available(device):
            return backend
    return _REGISTRY["reference"]


def invariant_backend(device: torch.device | str) -> Backend:
    """The backend of the batch-invariant ops (:data:`INVARIANT_OPS`) for tensors on ``device``:
    ``MINITE_STRICT_BACKEND``'s where set, else :func:`get_backend` ``(None, device)``. Its
    ``supports(op)`` says whether its kernel runs; where not, the caller runs the torch formulation.
    Learner and rollout engine ask the same question on the same device, so they run the same one."""
    name = settings().strict_backend
    if name is not None and name not in backend_names():
        raise ValueError(f"MINITE_STRICT_BACKEND={name!r}: unknown NVFP4 backend; known: {', '.join(backend_names())}")
    return get_backend(name, device)


def available_backends(device: torch.device | str | None = None) -> dict[str, str | None]:
    """name -> None if it runs on ``device``, else the reason it does not."""
    device = torch.device(device) if device is not None else None
    return {n: (None if _load(n).available(device) else _load(n).why_not(device)) for n in backend_names()}
