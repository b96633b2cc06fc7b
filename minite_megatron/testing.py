"""Assertion helpers for the numerical contract, shared by the test-suite and by anyone who
adds a backend: bitwise comparisons that say how many elements differ and where.
"""

from __future__ import annotations

import torch

from .nvfp4.tensor import NVFP4Tensor

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as an integer tensor of the same element size (contiguous)."""
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def _first_mismatches(diff: torch.Tensor, a: torch.Tensor, b: torch.Tensor, limit: int = 5) -> str:
    idx = diff.nonzero()[:limit]
    parts = []
    for i in idx:
        key = tuple(int(v) for v in i)
        va, vb = a[key], b[key]
        if a.dtype.is_floating_point and a.element_size() == 1:
            va, vb = va.float(), vb.float()
        parts.append(f"{key}: {va.item()!r} vs {vb.item()!r}")
    return "; ".join(parts)


def assert_bitwise_equal(
    actual: torch.Tensor, expected: torch.Tensor, name: str = "tensor", *, nan_equal: bool = False
) -> None:
    """``torch.equal`` on raw bits, with a report of how many elements differ and where.

    ``nan_equal``: a NaN matches any NaN (payloads and signs of NaN differ between torch's
    vectorised and scalar conversions, e.g. 0xFFFF vs 0x7FC0 in bf16)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype} != {expected.dtype}")
    ra, rb = raw_bits(actual.cpu()), raw_bits(expected.cpu())
    if torch.equal(ra, rb):
        return
    diff = ra != rb
    if nan_equal and actual.dtype.is_floating_point:
        diff &= ~(torch.isnan(actual.cpu().float()) & torch.isnan(expected.cpu().float()))
        if not bool(diff.any()):
            return
    n = int(diff.sum())
    raise AssertionError(
        f"{name}: {n} of {diff.numel()} elements ({100.0 * n / max(diff.numel(), 1):.4f}%) differ "
        f"bitwise; first: {_first_mismatches(diff, actual.cpu(), expected.cpu())}"
    )


def assert_nvfp4_equal(actual: NVFP4Tensor, expected: NVFP4Tensor, name: str = "q", *, image: bool = True) -> None:
    """Codes, block scales (linear layout), global scales and, where both carry one, the image.

    Codes of ``-0.0`` inputs may legitimately be 0 or 8 (implementations disagree on the sign
    of an exact negative zero); callers that feed -0.0 compare dequantized values there.
    """
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{name}: logical shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if actual.global_scale != expected.global_scale or tuple(actual.tile) != tuple(expected.tile):
        raise AssertionError(
            f"{name}: ({actual.global_scale}, {actual.tile}) != ({expected.global_scale}, {expected.tile})"
        )
    assert_bitwise_equal(actual.codes, expected.codes, f"{name}.codes")
    assert_bitwise_equal(actual.linear_scales(), expected.linear_scales(), f"{name}.block_scales")
    assert_bitwise_equal(actual.global_decode.reshape(-1), expected.global_decode.reshape(-1), f"{name}.global_decode")
    if image and actual.image is not None:
        assert_bitwise_equal(actual.bf16_image(), expected.image_fp32().to(torch.bfloat16), f"{name}.image", nan_equal=True)


def assert_within(actual: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, name: str = "tensor") -> None:
    """|actual - exact| <= bound element-wise (NaN never passes), with a report of the worst."""
    err = (actual.double().cpu() - exact.double().cpu()).abs()
    bad = ~(err <= bound.double().cpu())
    if bool(bad.any()):
        n = int(bad.sum())
        ratio = (err / bound.double().cpu().clamp_min(1e-300)).nan_to_num(float("inf"))
        worst = tuple(int(v) for v in torch.nonzero(ratio == ratio.max())[0])
        raise AssertionError(
            f"{name}: {n} of {err.numel()} elements outside the bound; worst at {worst}: "
            f"actual {actual[worst].item()!r}, exact {exact[worst].item()!r}, bound {bound[worst].item()!r}"
        )


def gemm_output_bound(exact: torch.Tensor, accumulation_bound: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Bound for a GEMM output rounded to ``out_dtype``: the fp32 accumulation bound plus one
    rounding of the output format (half an ulp relative, ``2^-p`` with p the significand bits)."""
    p = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[out_dtype]
    # one rounding of a value within the accumulation bound, plus a tiny-value floor for subnormals
    tiny = torch.finfo(out_dtype).tiny
    return accumulation_bound + 2.0**-p * (exact.abs() + accumulation_bound) + tiny


def attention_grad_gap_bound(q, k, v, grad_out, out_a, out_b, lse_gap: float, scale: float, causal: bool,
                             grads_a, grads_b):
    """Element-wise bound on ``|grads_a - grads_b|`` (each ``(dq, dk, dv)``) when one fused attention
    backward runs at the same ``q``, ``k``, ``v``, ``grad_out`` from two forward outputs ``out_a``,
    ``out_b`` (each rounded to q's dtype) whose log-sum-exps differ by at most ``lse_gap``.

    The backward computes ``D_i = dO_i . O_i``, ``P = exp(s - lse)``, ``dS = P (dO v^T - D)``,
    ``dq = scale dS k``, ``dk = scale dS^T q``, ``dv = P^T dO``. So the outputs enter only through
    ``D``: ``dD_i = dO_i . (O_a - O_b)_i`` moves ``dq_i`` by ``scale dD_i sum_j P_ij k_j`` and ``dk_j``
    by ``scale sum_i P_ij dD_i q_i``, ``dv`` not at all; the LSEs scale ``P`` by ``exp(-dlse)``
    (relative ``lse_gap``); each run rounds ``P`` and ``dS`` to q's dtype before its matmuls
    (``u = 2^-p`` each, ``2u`` between the runs), accumulates in fp32 in an order that may differ
    (atomics: ``Sk 2^-24`` relative of the magnitudes) and rounds the gradient once (one ulp apart);
    with GQA the per-query-head ``dk`` / ``dv`` may be rounded to q's dtype before the group sum
    (flash's backward does: another ``2u`` of those magnitudes).
    ``q`` [B, Hq, Sq, D], ``k``/``v`` [B, Hkv, Sk, D] (GQA), queries = the last Sq positions.
    Returns fp64 bounds shaped like ``grads_a``; computes ``[B, Hq, Sq, Sk]`` fp64 matrices.
    """
    p = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[q.dtype]
    group = q.shape[1] // k.shape[1]
    sq, sk, d = q.shape[2], k.shape[2], q.shape[3]
    qd, gd = q.double(), grad_out.double()
    kd, vd = (t.double().repeat_interleave(group, 1) for t in (k, v))
    s = qd @ kd.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1), float("-inf"))
    prob = torch.softmax(s, -1)
    del s
    oa, ob = out_a.double(), out_b.double()
    fp32_d = 2 * d * 2.0**-24 * (gd.abs() * torch.maximum(oa.abs(), ob.abs())).sum(-1)  # each D in fp32
    dd = ((gd * (oa - ob)).sum(-1).abs() + fp32_d)[..., None]  # [B, Hq, Sq, 1]
    ds = (prob * (gd @ vd.transpose(-1, -2) - (gd * oa).sum(-1, keepdim=True))).abs()
    gam = 2 * 2.0**-p + sk * 2.0**-24 + lse_gap
    bq = scale * (dd * (prob @ kd.abs()) + gam * (ds @ kd.abs()))
    gam_kv = gam + (2 * 2.0**-p if group > 1 else 0.0)
    bk = scale * ((prob * dd).transpose(-1, -2) @ qd.abs() + gam_kv * (ds.transpose(-1, -2) @ qd.abs()))
    bv = gam_kv * (prob.transpose(-1, -2) @ gd.abs())
    del prob, ds
    b, hkv = k.shape[0], k.shape[1]
    bk = bk.view(b, hkv, group, sk, d).sum(2)
    bv = bv.view(b, hkv, group, sk, v.shape[3]).sum(2)
    out = []
    for bound, ga, gb in zip((bq, bk, bv), grads_a, grads_b):
        ulp = 2.0 ** (1 - p) * torch.maximum(ga.double().abs(), gb.double().abs())
        out.append(bound + ulp + torch.finfo(q.dtype).tiny)
    return tuple(out)


# ---- host cost: what a step asks of the host -----------------------------------------------------
#: aten ops that make the host wait for a CUDA device when their operands live there (the result's
#: size or value is read back): ``.item()`` / ``int()`` / ``bool()`` (``_local_scalar_dense``,
#: ``is_nonzero``), ``nonzero`` and what is built on it (``masked_select``), ``unique``,
#: ``bincount``, ``torch.equal``. Boolean-mask indexing and ``repeat_interleave`` are classified
#: by their arguments (:class:`HostSyncCounter`).
SYNCING_OPS = frozenset({
    "_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "equal", "unique", "_unique", "_unique2",
    "unique_dim", "unique_consecutive", "bincount",
})


def _where() -> str:
    """``file:line function`` of the innermost caller outside torch, Triton, ``warnings`` and this module."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if not any(part in path for part in ("/torch/", "/triton/", "/warnings.py")) and path != __file__:
            return f"{'/'.join(path.rsplit('/', 3)[-3:])}:{frame.lineno} {frame.name}"
    return "?"


def _is_masked_fill(args, kwargs) -> bool:
    """Does this ``index_put_`` run as ``masked_fill_`` (no sync)? ``t[mask] = scalar``: one boolean
    index, a one-element host value, no accumulation (torch's ``canDispatchToMaskedFill``)."""
    value = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    defined = [i for i in args[1] if i is not None]
    return (not accumulate and isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu"
            and len(defined) == 1 and defined[0].dtype in (torch.bool, torch.uint8))


def _device_type(device) -> str | None:
    return None if device is None else torch.device(device).type


class HostSyncCounter:
    """Everything inside the ``with`` block that makes the host wait for a CUDA device, with where
    it was called (``file:line function``):

    * ``syncs``: ``(what, where)`` of each blocking call: the ops of :data:`SYNCING_OPS` on CUDA
      tensors, ``repeat_interleave`` of device repeats without ``output_size``, boolean-mask
      indexing (not ``t[mask] = scalar``, which runs as ``masked_fill_``), copies
      between host and device without ``non_blocking`` (``.cpu()``, ``.tolist()``,
      ``torch.tensor(list, device=cuda)``, ``.to(cuda)``), and ``torch.cuda.Event.synchronize``
      (torch's sync debug mode does not see it; Megatron's all-to-all dispatcher waits on one for
      its routing counts);
    * ``pageable_h2d``: host-to-device copies from pageable memory, ``non_blocking`` or not (the
      driver stages them and may wait; a pinned source with ``non_blocking=True`` never waits);
    * ``h2d``: every host-to-device copy;
    * ``debug_mode_warnings``: where torch's own sync debug mode
      (``torch.cuda.set_sync_debug_mode("warn")``) reported a synchronization: an independent
      count of the first kind (it also sees ``torch.tensor(list, device=cuda)``'s copy, which runs
      below the dispatch mode, and stream / device synchronizes; a synchronization inside a
      backward node of torch's own is reported where the backward was called).

    Op classification runs in a ``TorchDispatchMode`` (it sees the backward too); on a CPU there
    is no device, so nothing is counted but ``Event.synchronize`` calls. Use it in tests and
    benchmarks, never in a product path (the mode adds host work to every op).
    """

    def __init__(self):
        self.syncs: list[tuple[str, str]] = []
        self.pageable_h2d: list[tuple[str, str]] = []
        self.h2d: list[tuple[str, str]] = []
        self.debug_mode_warnings: list[str] = []

    def __enter__(self):
        import warnings

        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Classify(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                counter._classify(func, args, kwargs)
                return func(*args, **kwargs)

        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def showwarning(message, category, *a, **k):
            if "synchronizing CUDA operation" in str(message):
                counter.debug_mode_warnings.append(_where())
            else:
                shown(message, category, *a, **k)

        warnings.showwarning = showwarning
        self._event_sync = torch.cuda.Event.synchronize

        def event_synchronize(event):
            counter.syncs.append(("Event.synchronize", _where()))
            return counter._event_sync(event)

        torch.cuda.Event.synchronize = event_synchronize
        self._debug_mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else None
        if self._debug_mode is not None:
            torch.cuda.set_sync_debug_mode("warn")
        self._mode = _Classify()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        if self._debug_mode is not None:
            torch.cuda.set_sync_debug_mode(self._debug_mode)
        torch.cuda.Event.synchronize = self._event_sync
        self._warnings.__exit__(*exc)
        return False

    def _classify(self, func, args, kwargs) -> None:
        name = func._schema.name.split("::")[-1]
        flat = [a for v in args for a in (v if isinstance(v, (list, tuple)) else (v,))]
        cuda_args = any(isinstance(a, torch.Tensor) and a.is_cuda for a in flat)
        if name in SYNCING_OPS and cuda_args:
            self.syncs.append((name, _where()))
        elif name in ("lift_fresh", "lift_fresh_copy") and cuda_args:
            self.syncs.append(("torch.tensor(host data, device=cuda)", _where()))
        elif name == "repeat_interleave" and cuda_args and kwargs.get("output_size") is None:
            self.syncs.append(("repeat_interleave without output_size", _where()))
        elif name in ("index", "index_put", "index_put_") and cuda_args and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])):
            if not (name != "index" and _is_masked_fill(args, kwargs)):
                self.syncs.append((f"{name} with a boolean mask", _where()))
        elif name in ("_to_copy", "copy_"):
            if name == "copy_":
                dst, src = args[0].device.type, args[1]
                blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            else:
                src = args[0]
                dst = _device_type(kwargs.get("device")) or src.device.type
                blocking = not kwargs.get("non_blocking", False)
            if not isinstance(src, torch.Tensor):
                return
            what = f"{name} of {src.numel()} {str(src.dtype).replace('torch.', '')}"
            if src.device.type == "cpu" and dst == "cuda":
                where = _where()
                self.h2d.append((what, where))
                if not src.is_pinned():
                    self.pageable_h2d.append((what, where))
                if blocking:
                    self.syncs.append((f"blocking host-to-device {what}", where))
            elif src.device.type == "cuda" and dst == "cpu" and blocking:
                self.syncs.append((f"blocking device-to-host {what}", _where()))

    def report(self) -> str:
        """One line per distinct (what, where) with its count."""
        import collections

        lines = []
        for title, items in (("syncs", self.syncs), ("pageable host-to-device copies", self.pageable_h2d),
                             ("host-to-device copies", self.h2d)):
            lines.append(f"{title}: {len(items)}")
            lines += [f"  {n:4d}  {what} at {where}" for (what, where), n in collections.Counter(items).most_common()]
        lines.append(f"sync debug mode warnings: {len(self.debug_mode_warnings)}")
        lines += [f"  {n:4d}  at {where}" for where, n in collections.Counter(self.debug_mode_warnings).most_common()]
        return "\n".join(lines)


class AtenOpCounter:
    """Counts the ops dispatched inside the ``with`` block, forward and backward: aten ops and
    miniTE's custom ops (``minite::*``, one each: their bodies are not seen) by schema name, and
    Triton kernel launches as ``triton::<kernel>`` (under ``TRITON_INTERPRET=1`` the torch ops the
    interpreter runs inside a launch are not counted). A proxy for the host's work per step that
    a CPU can measure: each op is a trip through torch's dispatcher, most of them a kernel launch
    on a GPU. ``total`` (every entry), ``aten`` (without the Triton launches), ``by_op`` (a
    Counter). Runs in a ``TorchDispatchMode``, which makes miniTE's custom ops take the
    registered-op path (:mod:`minite_kernels.custom_op`): the same code and results."""

    def __init__(self):
        import collections

        self.by_op: "collections.Counter[str]" = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    @property
    def aten(self) -> int:
        return sum(n for op, n in self.by_op.items() if not op.startswith("triton::"))

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        by_op, depth = self.by_op, [0]

        class _Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not depth[0]:
                    by_op[func._schema.name] += 1
                return func(*args, **(kwargs or {}))

        self._patched = []
        try:
            import triton.runtime.interpreter as interpreter
            import triton.runtime.jit as jit
        except ImportError:  # no Triton: aten ops only
            targets = []
        else:
            targets = [interpreter.InterpretedFunction, jit.JITFunction]
        for cls in targets:
            run = cls.run

            def counted(fn, *a, _run=run, **k):
                by_op["triton::" + getattr(getattr(fn, "fn", fn), "__name__", "?")] += 1
                depth[0] += 1
                try:
                    return _run(fn, *a, **k)
                finally:
                    depth[0] -= 1

            cls.run = counted
            self._patched.append((cls, run))
        self._mode = _Count()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for cls, run in self._patched:
            cls.run = run
        return False
