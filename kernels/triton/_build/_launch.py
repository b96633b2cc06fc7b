"""A leaner host path for launching the repository's Triton kernels: ``@fast_jit`` instead of ``@triton.jit``.

Triton 3.6's ``JITFunction.run`` costs ~18 us of host time per launch on the H200 machine (argument
binding, specialization, cache key, a check of the kernel's globals, launch metadata), of which the
launch itself (the compiled kernel's ``run``) is ~7 us (``/work/tools/launch_probe.py``, 2026-12-01).
A learner step of the qwen3-moe preset makes ~290 launches, and at 4096 tokens the step waits on the
host (issue 16).

:class:`FastJITFunction` is a ``JITFunction`` whose ``run`` first looks the launch up in its own
table, keyed by a *specialization key at least as fine as Triton's*: per parameter, a constexpr's
value; a tensor's dtype and whether its address is a multiple of 16; an int's ``== 1`` and ``% 16 == 0``
(unless the parameter is ``do_not_specialize``) and its integer class (i32 / i64 / u64); a bool's value;
float and None by type; plus the launch options (``num_warps``, ``num_stages``, ...) and the device.
Two launches with the same key compile to the same kernel under Triton's rules, so a hit launches the
compiled kernel Triton returned for that key directly (``CompiledKernel.run``, the same call Triton
makes). A miss, and anything the key does not cover (another argument type, a callable grid, warmup,
launch hooks such as a profiler's, pre-run hooks), takes Triton's own path unchanged; a miss records
the compiled kernel Triton returns. Under ``TRITON_INTERPRET=1`` ``fast_jit`` is ``triton.jit``.
Off unless ``MINITE_FAST_LAUNCH=1``: the table has not yet launched a kernel on a GPU. Its first GPU
check (H200, 2026-12-01) found the table empty -- Triton 3.6 holds an empty ``HookChain`` where no
launch hook is set, which the ``is not None`` test took for a hook, so every launch took Triton's
path; that is fixed (:func:`_hooked`, a CPU test pins it) after the session's device time was spent.
The check that turns it on: ``tests/kernels/triton/_build/test_fast_launch.py`` on a GPU (launches real kernels
through the table, hits included, and with it off: the same bits), then the 4096-token learner step
with ``MINITE_FAST_LAUNCH=1`` and ``=0``.
"""

from __future__ import annotations

import inspect
import os

import torch
import triton
from triton import knobs
from triton.runtime.jit import JITFunction

#: ``MINITE_FAST_LAUNCH=1``: launches through the table (module docstring: not yet run on a GPU).
ENABLED = os.environ.get("MINITE_FAST_LAUNCH", "0") == "1"

_I32_MIN, _I32_MAX, _I64_MAX = -(2**31), 2**31, 2**63


def _hooked(hook) -> bool:
    """Is a launch hook set? Triton 3.6 holds an empty ``HookChain`` when none is."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _int_class(v: int) -> int:
    return 0 if _I32_MIN <= v < _I32_MAX else (1 if v < _I64_MAX else 2)


class FastJITFunction(JITFunction):
    """``JITFunction`` with a launch table (module docstring). Built by :func:`fast_jit`."""

    def _fast_setup(self) -> None:
        params = self.params
        self._fast_table: dict = {}
        self._fast_names = [p.name for p in params]
        self._fast_index = {p.name: i for i, p in enumerate(params)}
        self._fast_const = [p.is_constexpr for p in params]
        self._fast_dns = [p.do_not_specialize for p in params]
        self._fast_defaults = [p.default for p in params]
        self._fast_empty = inspect.Parameter.empty

    def _fast_bind(self, args, kwargs):
        """(all parameter values in order, the launch options as a sorted tuple) or None."""
        n = len(self._fast_names)
        if len(args) > n:
            return None
        vals = list(args) + [self._fast_empty] * (n - len(args))
        opts = []
        for k, v in kwargs.items():
            i = self._fast_index.get(k)
            if i is None:
                opts.append((k, v))
            else:
                vals[i] = v
        for i in range(len(args), n):
            if vals[i] is self._fast_empty:
                d = self._fast_defaults[i]
                if d is self._fast_empty:
                    return None
                vals[i] = d
        opts.sort()
        return vals, tuple(opts)

    def _fast_key(self, vals, opts, device):
        key = [device, opts]
        const, dns = self._fast_const, self._fast_dns
        for i, v in enumerate(vals):
            if const[i]:
                key.append(v)
            elif isinstance(v, torch.Tensor):
                key.append((v.dtype, v.data_ptr() & 15 == 0))
            elif v is None:
                key.append(None)
            elif isinstance(v, bool):
                key.append(("b", v))
            elif isinstance(v, int):
                key.append(("i", _int_class(v)) if dns[i] else ("i", v == 1, v % 16 == 0, _int_class(v)))
            elif isinstance(v, float):
                key.append("f")
            else:
                return None
        return tuple(key)  # (hashed at the table lookup: an unhashable value takes Triton's path there)

    def run(self, *args, grid, warmup, **kwargs):
        if (warmup or not ENABLED or callable(grid) or self.pre_run_hooks
                or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)):
            return super().run(*args, grid=grid, warmup=warmup, **kwargs)
        bound = self._fast_bind(args, kwargs)
        if bound is None:
            return super().run(*args, grid=grid, warmup=warmup, **kwargs)
        vals, opts = bound
        device = torch.cuda.current_device()
        key = self._fast_key(vals, opts, device)
        if key is None:
            return super().run(*args, grid=grid, warmup=warmup, **kwargs)
        try:
            kernel = self._fast_table.get(key)
        except TypeError:  # an unhashable constexpr or option value
            return super().run(*args, grid=grid, warmup=warmup, **kwargs)
        if kernel is None:
            kernel = super().run(*args, grid=grid, warmup=warmup, **kwargs)
            if kernel is not None and not hasattr(kernel, "result"):
                self._fast_table[key] = kernel
            return kernel
        g = len(grid)
        stream = torch._C._cuda_getCurrentRawStream(device)  # what Triton's driver asks torch for
        kernel.run(grid[0], grid[1] if g > 1 else 1, grid[2] if g > 2 else 1, stream, kernel.function,
                   kernel.packed_metadata, None, None, None, *vals)
        return kernel


def fast_jit(fn=None, **kwargs):
    """``@triton.jit`` (same arguments) returning a :class:`FastJITFunction`; plain ``triton.jit``
    under the interpreter."""

    def wrap(f):
        k = triton.jit(f, **kwargs)
        if type(k) is JITFunction:
            k.__class__ = FastJITFunction
            k._fast_setup()
        return k

    return wrap(fn) if fn is not None else wrap
