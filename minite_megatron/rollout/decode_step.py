"""One decode step of a Megatron ``GPTModel`` over a static KV cache, on the learner's own modules.

:class:`DecodeModel` walks the model once (:mod:`.support` says which models it knows) and then
runs a decode step -- one new token for each of ``B`` sequences at its own position -- with no
host sync, so the whole step can be captured in a CUDA graph (:mod:`.cuda_graphs`). It calls
the learner's modules wherever a module is pure device code reading its parameters in place:
the embedding, every norm (miniTE's offer their fused NVFP4 quantization to the next linear,
:mod:`minite_megatron.ops.producers`), q/k layernorms, Megatron's ``apply_rotary_pos_emb``, the
layer's own ``core_attention`` (strict attention in strict mode; Megatron's in default mode),
the router (FP32 gating, its top-k), BF16 linears, the bias-dropout-add functions, the activation
modules, the final norm and the LM head. Three things it does itself, with the learner's ops:

* **NVFP4 linears** (:func:`nvfp4_linear_step`): ``quantize_activation`` (the learner's quantizer,
  taking a fused producer's handoff) and ``backend.gemm`` on the module's quantized weight, held
  at a fixed address (:mod:`.decode_weights`) -- the learner's bytes, never re-quantized.
* **Attention over the static cache**: q/k/v split as ``SelfAttention.get_query_key_value_tensors``
  does, RoPE at each row's position, the new key/value written into the cache at that position,
  then ``core_attention(q [1, B, np, hn], K [S, B, ng, hn], V, mask [B, 1, 1, S])`` over the whole
  cache with the keys after each row's position hidden (Megatron's own static decode passes the
  same module ``key[:end]``; hidden keys give exact zero probabilities, and the strict attention
  is invariant to them by construction). ``attention="sdpa"`` uses
  ``torch.nn.functional.scaled_dot_product_attention`` instead (the BF16 baseline engine).
* **MoE without the training dispatcher** (:func:`moe_step`): the router's top-k experts of each
  token in increasing expert order, the token's per-row NVFP4 quantization gathered to its
  ``B*k`` (token, expert) rows, ``backend.decode_grouped_gemm`` on the stacked expert weights
  (only the selected experts' bytes are read), the experts' activation and probability scaling as
  ``TEGroupedMLP`` / ``SequentialMLP`` compute them, fc2 the same way, and
  :func:`minite_megatron.modules.deterministic_moe.ordered_sum` -- the deterministic combine's order (the
  minite specs' MoE layers use it in both modes). BF16 experts: ``torch._grouped_mm`` on stacked
  weights, or, for strict BF16 experts, each expert's own modules on its rows (a host loop:
  eager only).

**Fused kernels** (:mod:`.fused_ops`, on the GPU; on a CPU the learner's modules run unless
``kernels_on_cpu=True``; none with ``fused_kernels=False``: :class:`DecodeModel`'s options, the
backend chosen once and held by every step): where the learner's modules are the batch-invariant
formulations (strict mode, or default mode's ``recipe.aligned_ops``) a few kernels with the same bits stand in for chains of small ops --
q/k RMSNorm + RoPE + KV-cache write of all heads (``minite_kernels.triton.decode.qk_norm_rope``), the
router's top-k + softmax + Megatron's expert-major rows after the learner's own gating
(``moe_route``), the experts' SwiGLU times the routing weight -> NVFP4 (``swiglu_quantize``), the
grouped GEMMs told the rows are sorted (``decode_grouped_gemm(group_offsets=)``), and the
combine (``moe_combine``). A step of the qwen3-moe preset's structure runs ~100 kernels instead
of ~470 (``python -m benchmarks.kernels --sections decode_count``). While a tracer fires the modules' hooks,
the unfused path runs (same bits).

The prefill is the learner's forward itself (``GPTModel.forward`` over the padded prompts, as
``teacher_forced_logprobs`` runs it), with a pre-hook on every ``core_attention`` that copies the
keys and values it receives (after RoPE) into the cache: prompt log-probs are the learner's.

``invariant_gemm=True`` (default mode) makes the decode GEMMs take the batch-invariant
configurations (``batch_invariant=True``), whose accumulation order equals the learner's
full-batch GEMMs (:mod:`minite_kernels.triton.nvfp4.gemm`: one BLOCK_K and K order for every tile
configuration; measured bitwise on the H200 for qkv, proj and the grouped experts, BENCHMARKS.md
run 7), instead of the fast decode kernels: the MoE experts on the integer-dot kernel
(:mod:`minite_kernels.triton.decode.decode_grouped_idot`: exact block sums, fp32 across blocks, row
invariant), the dense GEMMs split-K. Strict mode always takes the invariant configurations.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.utils import GlobalMemoryBuffer

from ..modules.grouped_linear import NVFP4GroupedLinear
from ..nvfp4.tensor import NVFP4Tensor
from ..ops.handoff import activation_key, clear_all
from ..ops.linear import backend_for, quantize_activation, takes_handed_quantization
from ..modules.deterministic_moe import ordered_sum
from ..nvfp4.backends import kernel_backend
from . import fused_ops
from .decode_weights import DecodeWeights, StaticWeight, stacked_nvfp4
from .support import is_nvfp4_linear, unwrap_gpt


def module_call(module, args: tuple, compute, fire: bool):
    """``compute()`` standing in for ``module(*args)``: with ``fire``, the module's forward
    pre-hooks and hooks run around it as if the module had been called (a diagnostics tracer
    records its output; eager steps only -- a CUDA graph cannot replay Python hooks)."""
    if not fire:
        return compute()
    for hook in list(module._forward_pre_hooks.values()):
        hook(module, args)
    out = compute()
    for hook in list(module._forward_hooks.values()):
        hook(module, args, out)
    return out


class KVCache:
    """Static keys and values of every layer: ``[S, B, ng, hn]`` views of one flat buffer per
    layer (contiguous for every batch bucket ``B <= max_batch``), zeroed by :meth:`reset`."""

    def __init__(self, num_layers: int, max_seq: int, max_batch: int, groups: int, head_dim: int, dtype, device):
        self.max_seq, self.max_batch, self.groups, self.head_dim = max_seq, max_batch, groups, head_dim
        n = max_seq * max_batch * groups * head_dim
        self.k = [torch.zeros(n, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(n, dtype=dtype, device=device) for _ in range(num_layers)]

    def view(self, layer: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.max_seq * batch * self.groups * self.head_dim
        shape = (self.max_seq, batch, self.groups, self.head_dim)
        return self.k[layer][:n].view(shape), self.v[layer][:n].view(shape)

    def reset(self) -> None:
        for t in self.k + self.v:
            t.zero_()


# ---- linears ------------------------------------------------------------------------------------
class LinearStep:
    """A linear of the decode step: a miniTE NVFP4 linear on its fixed-address quantized weight,
    or any other Megatron linear called as the learner calls it. ``__call__(x) -> (out, bias)``."""

    def __init__(self, module, invariant: bool, weights: list):
        self.module = module
        self.nvfp4 = is_nvfp4_linear(module)
        self.weight = None
        if self.nvfp4:
            recipe = module.recipe
            self.invariant = bool(recipe.strict or invariant)
            from ..modules.linear import NVFP4RowParallelLinear

            self.row = isinstance(module, NVFP4RowParallelLinear)
            self.weight = weights.nvfp4(module.quantized_weight)
            weights.append(self.weight)

    def __call__(self, x: torch.Tensor, fire: bool = False):
        m = self.module
        if not self.nvfp4:
            return m(x)
        return module_call(m, (x,), lambda: self._nvfp4(x), fire)

    def _nvfp4(self, x):
        m = self.module
        bias = None if (m.bias is None or m.skip_bias_add) else m.bias
        out = nvfp4_linear_step(x, self.weight.value, None if self.row else bias, m.minite_ctx, self.invariant)
        if self.row and bias is not None:  # Megatron's RowParallelLinear adds its bias after the reduction
            out = out + bias
        return out, (m.bias if m.skip_bias_add else None)


def nvfp4_linear_step(x: torch.Tensor, qw: NVFP4Tensor, bias, lctx, invariant: bool) -> torch.Tensor:
    """``x @ W^T (+ bias)`` as the learner's NVFP4 forward computes it (its quantizer, the
    backend's GEMM), on a given quantized weight; ``x`` ``[..., K]``."""
    backend = backend_for(lctx.recipe, x.device)
    x2 = x.reshape(-1, x.shape[-1])
    qx = quantize_activation(x2, lctx, backend)
    y = backend.gemm(qx, qw, bias, out_dtype=x.dtype, batch_invariant=invariant)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _gather_rows(q: NVFP4Tensor, rows: torch.Tensor) -> NVFP4Tensor:
    """Rows ``rows`` of a per-row quantized ``[T, K]`` NVFP4 matrix (every field gathered)."""
    from dataclasses import replace

    g = q.global_decode[rows] if q.global_scale == "row" else q.global_decode
    return replace(q, codes=q.codes[rows], block_scales=q.block_scales.view(torch.uint8)[rows].view(q.block_scales.dtype),
                   global_decode=g, shape=torch.Size([rows.numel(), q.k]),
                   image=None if q.image is None else q.image[rows])


# ---- activations --------------------------------------------------------------------------------
def _glu(config, x):
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    if (val := config.activation_func_clamp_value) is not None:
        x_glu = x_glu.clamp(min=None, max=val)
        x_linear = x_linear.clamp(min=-val, max=val)
    return config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)


def mlp_activation(owner, x: torch.Tensor, bias, probs: torch.Tensor | None) -> torch.Tensor:
    """The activation ``MLP.forward`` (``per_token_scale=probs``) or ``TEGroupedMLP`` applies to
    fc1's output ``x`` (with fc1's bias), times the routing probabilities if given."""
    config = owner.config
    if config.use_te_activation_func:
        if bias is not None:
            x = x + bias
        x = owner.activation_func(x)
    elif config.bias_activation_fusion:  # SwiGLU (support.py refuses the other fusions)
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl, weighted_bias_swiglu_impl

        if probs is not None:
            return weighted_bias_swiglu_impl(x, bias, probs.unsqueeze(-1), config.activation_func_fp8_input_store)
        return bias_swiglu_impl(x, bias, config.activation_func_fp8_input_store, False)
    else:
        if bias is not None:
            x = x + bias
        x = _glu(config, x) if config.gated_linear_unit else owner.activation_func(x)
    if probs is not None:
        dtype = x.dtype
        x = (x * probs.unsqueeze(-1)).to(dtype)
    return x


class MLPStep:
    """A dense MLP (or shared experts): fc1, the MLP's activation, fc2."""

    def __init__(self, mlp, invariant: bool, weights: list):
        self.mlp = mlp
        self.fc1 = LinearStep(mlp.linear_fc1, invariant, weights)
        self.fc2 = LinearStep(mlp.linear_fc2, invariant, weights)

    def __call__(self, x: torch.Tensor, fire: bool = False):
        def compute():
            h, b = self.fc1(x, fire)
            return self.fc2(mlp_activation(self.mlp, h, b, None), fire)

        return module_call(self.mlp, (x,), compute, fire)


# ---- MoE ----------------------------------------------------------------------------------------
def routed_experts(routing_map: torch.Tensor, probs: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k experts of each token in increasing expert index (the order of Megatron's
    expert-major permutation) and their probabilities: ``([T, k] int64, [T, k])``. No sync."""
    e = routing_map.shape[1]
    rank = routing_map.to(torch.int32) * (e - torch.arange(e, device=routing_map.device, dtype=torch.int32))
    experts = torch.topk(rank, topk, dim=1, sorted=True).indices  # distinct keys: lowest expert first
    return experts, torch.gather(probs, 1, experts)


class ExpertsStep:
    """The routed experts of one MoE layer for ``R = T * k`` (token, expert) rows; ``fused``: the
    backend of the fused decode kernels (:func:`.fused_ops.fused_backend`) or None."""

    def __init__(self, experts, invariant: bool, weights: list, fused):
        self.experts = experts
        self.fused = fused
        self.owner = experts  # whose activation: TEGroupedMLP's, or the local experts' MLP
        if isinstance(experts, TEGroupedMLP):
            fc1, fc2 = experts.linear_fc1, experts.linear_fc2
            self.kind = "nvfp4" if fc1.precision == "nvfp4" else "dense"
            if self.kind == "nvfp4":
                # images only where the learner's order may need them (a backend's fallback
                # for an unverified strict decode kernel multiplies images)
                keep = bool(invariant or fc1.recipe.strict)
                self.w1 = weights.nvfp4(fc1.quantized_weight, keep_image=keep)
                self.w2 = weights.nvfp4(fc2.quantized_weight, keep_image=keep)
                self.lctx1, self.lctx2 = fc1.minite_ctx, fc2.minite_ctx
                self.recipe = fc1.recipe
            else:
                self.w1 = StaticWeight(lambda: fc1.weights)
                self.w2 = StaticWeight(lambda: fc2.weights)
                self.recipe = fc1.recipe
            strict = self.recipe.strict
        else:  # SequentialMLP of MLPs
            local = list(experts.local_experts)
            self.owner = local[0]
            fc1s, fc2s = [e.linear_fc1 for e in local], [e.linear_fc2 for e in local]
            if all(is_nvfp4_linear(m) for m in fc1s + fc2s):
                self.kind = "nvfp4"
                self.w1 = StaticWeight(stacked_nvfp4(fc1s), keep_image=False)
                self.w2 = StaticWeight(stacked_nvfp4(fc2s), keep_image=False)
                self.lctx1, self.lctx2 = fc1s[0].minite_ctx, fc2s[0].minite_ctx
                self.recipe = fc1s[0].recipe
                strict = self.recipe.strict
            else:
                strict = any(getattr(m, "minite_strict", False) or getattr(getattr(m, "recipe", None), "strict", False)
                             for m in fc1s + fc2s)
                biased = any(m.bias is not None for m in fc1s + fc2s)
                self.kind = "loop" if (strict or biased) else "dense"
                if self.kind == "dense":
                    self.w1 = StaticWeight(lambda: [m.weight for m in fc1s])
                    self.w2 = StaticWeight(lambda: [m.weight for m in fc2s])
        if self.kind == "dense" and strict:
            self.kind = "loop"  # one batch-invariant GEMM per expert
        self.invariant = bool(strict or invariant)
        for w in ("w1", "w2"):
            if hasattr(self, w):
                weights.append(getattr(self, w))

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, fire: bool = False) -> torch.Tensor:
        """``x`` [T, H], ``experts``/``weights`` [T, k] -> fc2 outputs ``[T, k, H]``.

        Rows are (token, expert) pairs token-major; with ``fire`` (tracing) they are computed in
        Megatron's expert-major permutation, as the hooks of the expert modules expect."""
        t, k = experts.shape
        tok = torch.arange(t, device=x.device).repeat_interleave(k)
        ids, probs = experts.reshape(-1), weights.reshape(-1)
        perm = None
        if fire:
            perm = torch.argsort(ids * t + tok)
            tok, ids, probs = tok[perm], ids[perm], probs[perm]
        if self.kind == "nvfp4" and isinstance(self.experts, TEGroupedMLP):
            y = module_call(self.experts, (x,), lambda: self._nvfp4(x, tok, ids, probs, fire), fire)
        elif self.kind == "nvfp4" and not fire:
            y = self._nvfp4(x, tok, ids, probs, False)
        elif isinstance(self.experts, TEGroupedMLP):
            y = module_call(self.experts, (x,), lambda: self._sorted(x, tok, ids, probs, fire), fire)
        elif self.kind == "dense" and not fire:
            y = self._sorted(x, tok, ids, probs, False)
        else:
            y = self._loop(x, tok, ids, probs)
        if perm is not None:
            y = torch.empty_like(y).index_copy_(0, perm, y)
        return y.view(t, k, -1)

    # ---- the fused decode path: rows already in expert-major order -----------------------------
    def sorted_supported(self) -> bool:
        """Can :meth:`sorted_rows` run these experts (packed NVFP4 weights of grouped experts)?"""
        return self.kind == "nvfp4"

    def input_ctx(self, device: torch.device):
        """fc1's ``LinearContext`` where the experts can take the T tokens' NVFP4 from the norm
        before them (per-token scales, and a backend that reads each (token, expert) row's token
        row by index: ``decode_grouped_gemm(..., a_rows=)``), else None."""
        if self.kind != "nvfp4" or not takes_handed_quantization(self.lctx1):
            return None
        backend = backend_for(self.recipe, device)
        why = backend.supports("decode_grouped_gemm", a_rows=True, batch_invariant=self.invariant, device=device)
        return self.lctx1 if why is None else None

    def sorted_rows(self, x: torch.Tensor, route, qx: NVFP4Tensor | None = None) -> torch.Tensor:
        """fc2 outputs ``[T * k, H]`` of the expert-major rows of ``route`` (a
        :class:`~minite_kernels.triton.moe.moe_route.Route`) for tokens ``x`` ``[T, H]``: the rows of
        Megatron's permutation, quantized per row as the learner quantizes them, the grouped
        decode GEMMs on the stacked weights (the backend is told the rows are sorted), the
        experts' activation times the routing probabilities (one fused SwiGLU -> NVFP4 kernel on
        the GPU where ``fused`` has it, :func:`.fused_ops.use_kernels`), fc2. ``qx``: the tokens'
        quantization as fc1 quantizes them (the norm's, :meth:`input_ctx`): fc1 reads each row's
        token row of it by index (per-token scales: the bits of quantizing the gathered rows)."""
        backend = backend_for(self.recipe, x.device)
        a_rows = route.tokens
        if qx is None:  # the rows gathered and quantized here
            qx, a_rows = quantize_activation(x.index_select(0, route.tokens), self.lctx1, backend), None
        h = backend.decode_grouped_gemm(qx, self.w1.value, route.ids, out_dtype=x.dtype, batch_invariant=self.invariant,
                                        group_offsets=route.offsets, a_rows=a_rows)
        if self._fused_activation(h, backend):
            _a, qa = backend.swiglu_quantize(h, with_image=True, nonfinite=self.recipe.nonfinite, probs=route.probs)
        else:
            qa = quantize_activation(mlp_activation(self.owner, h, None, route.probs), self.lctx2, backend)
        return backend.decode_grouped_gemm(qa, self.w2.value, route.ids, out_dtype=x.dtype,
                                           batch_invariant=self.invariant, group_offsets=route.offsets)

    def _fused_activation(self, h: torch.Tensor, backend) -> bool:
        """Is the experts' activation Megatron's plain SwiGLU (what ``swiglu_quantize`` computes)?"""
        c = self.owner.config
        return (fused_ops.use_kernels(self.fused, "weighted_swiglu", dtype=h.dtype, width=h.shape[-1])
                and backend.supports("swiglu_quantize") is None and self.recipe.activation_scale == "row"
                and h.dtype in (torch.bfloat16, torch.float16) and h.shape[-1] % 32 == 0
                and c.gated_linear_unit and c.activation_func is torch.nn.functional.silu
                and not c.bias_activation_fusion and c.activation_func_clamp_value is None
                and not c.glu_linear_offset and getattr(c, "moe_mlp_glu_interleave_size", None) is None)

    def _fc(self, module, x, compute, fire: bool):
        """A grouped linear's output, its hooks fired (``TEGroupedMLP`` experts only)."""
        if fire and isinstance(self.experts, TEGroupedMLP):
            return module_call(module, (x, None), lambda: (compute(), None), True)[0]
        return compute()

    def _nvfp4(self, x, tok, ids, probs, fire: bool):
        backend = backend_for(self.recipe, x.device)
        ids32 = ids.to(torch.int32)
        grouped = isinstance(self.experts, TEGroupedMLP)
        fc1 = self.experts.linear_fc1 if grouped else None
        fc2 = self.experts.linear_fc2 if grouped else None

        def first():
            if fire:  # the permuted rows, quantized as the learner quantizes them (same bits per row)
                qx = quantize_activation(x[tok], self.lctx1, backend)
            else:  # per-token scales: quantizing the tokens once and gathering is the same
                qx = _gather_rows(quantize_activation(x, self.lctx1, backend), tok)
            return backend.decode_grouped_gemm(qx, self.w1.value, ids32, out_dtype=x.dtype, batch_invariant=self.invariant)

        h = self._fc(fc1, x[tok] if fire else x, first, fire)
        a = mlp_activation(self.owner, h, None, probs)

        def second():
            qa = quantize_activation(a, self.lctx2, backend)
            return backend.decode_grouped_gemm(qa, self.w2.value, ids32, out_dtype=x.dtype, batch_invariant=self.invariant)

        return self._fc(fc2, a, second, fire)

    def _sorted(self, x, tok, ids, probs, fire: bool):
        """BF16 experts on rows sorted by expert: ``torch._grouped_mm`` (device offsets, no sync),
        or for strict experts one batch-invariant GEMM per expert (host loop)."""
        order = torch.argsort(ids, stable=True)
        xs, ps = x[tok[order]], probs[order]
        grouped = isinstance(self.experts, TEGroupedMLP)
        if self.kind == "dense":
            e = self.w1.value.shape[0]
            counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
                0, ids, torch.ones_like(ids, dtype=torch.int32))
            offs = torch.cumsum(counts, 0, dtype=torch.int32)

            def gemm(linear, w, inp):
                return torch._grouped_mm(inp, w.value.transpose(1, 2), offs=offs)
        else:
            sizes = torch.bincount(ids, minlength=self.experts.num_local_experts).tolist()

            def gemm(linear, w, inp):
                parts = torch.split(inp, sizes)
                return torch.cat([_grouped_bf16_expert(linear, g, p) for g, p in enumerate(parts) if p.shape[0]])

        fc1 = self.experts.linear_fc1 if grouped else None
        fc2 = self.experts.linear_fc2 if grouped else None
        h = self._fc(fc1, xs, lambda: gemm(fc1, getattr(self, "w1", None), xs), fire)
        a = mlp_activation(self.owner, h, None, ps)
        y = self._fc(fc2, a, lambda: gemm(fc2, getattr(self, "w2", None), a), fire)
        return torch.empty_like(y).index_copy_(0, order, y)

    def _loop(self, x, tok, ids, probs):
        """Each local expert's own module on its rows (``SequentialMLP``; eager only: the row
        counts are read on the host). Hooks fire as in the learner's forward."""
        out = None
        for e in ids.unique().tolist():
            rows = (ids == e).nonzero().reshape(-1)
            y, _ = self.experts.local_experts[e](x[tok[rows]], probs[rows])
            out = y.new_empty(ids.numel(), y.shape[-1]) if out is None else out
            out[rows] = y
        return out


def _grouped_bf16_expert(linear: NVFP4GroupedLinear, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of a BF16-precision grouped linear on rows ``x``, as its forward computes it."""
    if linear.recipe.strict:
        from ..invariant.matmul import linear as batch_invariant_linear

        return batch_invariant_linear(x, linear.weights[e], None)
    return torch.nn.functional.linear(x, linear.weights[e], None)


class CombinedRows:
    """An MoE layer's output before its combine: the expert rows ``[T * k, H]`` and the route's
    ``combine`` index (token ``t``'s rows at ``t * k .. t * k + k - 1``). The next norm adds them
    into the residual stream in its own kernel where it can (:func:`add_then_norm`); anything else
    takes :meth:`tensor` (``fused_ops.combine_rows``: the same bits)."""

    def __init__(self, rows: torch.Tensor, combine: torch.Tensor, k: int, shape: tuple, fused):
        self.rows, self.combine, self.k, self.shape, self.fused = rows, combine, k, torch.Size(shape), fused
        self.dtype, self.device = rows.dtype, rows.device

    def tensor(self) -> torch.Tensor:
        return fused_ops.combine_rows(self.rows, self.combine, self.k, backend=self.fused).view(self.shape)


class MoEStep:
    """An MoE layer: the router (module), the routed experts, the ordered combine, shared experts.
    ``fused``: the backend of the fused decode kernels or None; ``routing``: the backend whose
    ``moe_route`` limits say which token counts take the expert-major rows (:func:`.fused_ops.route_supported`)."""

    def __init__(self, moe: MoELayer, invariant: bool, weights: list, fused, routing):
        self.moe = moe
        self.topk = moe.router.topk
        self.fused, self.routing = fused, routing
        self.experts = ExpertsStep(moe.experts, invariant, weights, fused)
        self.shared = MLPStep(moe.shared_experts, invariant, weights) if moe.use_shared_expert else None

    def fused_supported(self, tokens: int) -> bool:
        """The routing kernel and the expert-major rows can stand in for the router module and
        :class:`ExpertsStep`'s token-major rows (same bits; not while tracing)."""
        return fused_ops.route_supported(self.moe.router, tokens, self.routing) and self.experts.sorted_supported()

    def input_ctx(self, device: torch.device):
        """fc1's ``LinearContext`` where the routed experts take the tokens' NVFP4 from the norm
        before the layer (:meth:`ExpertsStep.input_ctx`), else None."""
        return self.experts.input_ctx(device)

    def __call__(self, x: torch.Tensor, fire: bool = False, qx: NVFP4Tensor | None = None):
        """``qx``: ``x``'s NVFP4 as fc1 quantizes it (the fused norm's, :meth:`input_ctx`) or None."""
        def compute():
            s, b, h = x.shape
            x2 = x.reshape(s * b, h)
            if not fire and self.fused_supported(s * b):
                router = self.moe.router
                logits = router.gating(x2)  # the learner's FP32 batch-invariant gating
                route = fused_ops.moe_route(logits.view(s * b, -1), self.topk,
                                            router.config.moe_router_topk_scaling_factor, backend=self.fused)
                rows = self.experts.sorted_rows(x2, route, qx)
                out = CombinedRows(rows, route.combine, self.topk, (s, b, h), self.fused)
                if self.shared is not None:
                    out = out.tensor()
            else:
                probs, routing_map = self.moe.router(x)
                experts, weights = routed_experts(routing_map, probs, self.topk)
                rows = self.experts(x2, experts, weights, fire)
                out = ordered_sum(rows).view(s, b, h)
            if self.shared is not None:
                shared, _ = self.shared(x, fire)
                out = out + shared
            return out, None

        return module_call(self.moe, (x,), compute, fire)


# ---- attention ----------------------------------------------------------------------------------
class AttentionStep:
    """``SelfAttention`` over the static cache (see the module docstring); ``fused``: the backend of
    the fused decode kernels (q/k norm + RoPE + cache write) or None."""

    def __init__(self, index: int, attn, invariant: bool, weights: list, mode: str, fused):
        self.index, self.attn, self.mode, self.fused = index, attn, mode, fused
        self.qkv = LinearStep(attn.linear_qkv, invariant, weights)
        self.proj = LinearStep(attn.linear_proj, invariant, weights)
        self.np = attn.num_attention_heads_per_partition
        self.ng = attn.num_query_groups_per_partition
        self.hn = attn.hidden_size_per_attention_head

    def split(self, mixed: torch.Tensor):
        """``SelfAttention.get_query_key_value_tensors``' split of ``linear_qkv``'s output."""
        per = self.np // self.ng
        mixed = mixed.view(*mixed.shape[:-1], self.ng, (per + 2) * self.hn)
        q, k, v = torch.split(mixed, [per * self.hn, self.hn, self.hn], dim=3)
        q = q.reshape(q.size(0), q.size(1), -1, self.hn)
        attn = self.attn
        if attn.q_layernorm is not None:
            q = attn.q_layernorm(q)
        if attn.k_layernorm is not None:
            k = attn.k_layernorm(k)
        return q, k, v

    def __call__(self, x, rope, hidden, rows, positions, cache: KVCache, fire: bool = False):
        return module_call(self.attn, (x,), lambda: self._attend(x, rope, hidden, rows, positions, cache, fire), fire)

    def _qk_norms(self):
        """``(q weight, k weight, eps, zero_centered)`` of the q/k norms if they are the
        batch-invariant RMSNorm computed by ``bi_rmsnorm`` here (what the fused kernel
        reproduces), ``(None, None, 0, False)`` without qk-layernorm, else None."""
        from megatron.core.transformer.identity_op import IdentityOp

        from ..modules.norm import MiniteNorm

        qn, kn = self.attn.q_layernorm, self.attn.k_layernorm
        if (qn is None or isinstance(qn, IdentityOp)) and (kn is None or isinstance(kn, IdentityOp)):
            return None, None, 0.0, False
        if not (isinstance(qn, MiniteNorm) and isinstance(kn, MiniteNorm)):
            return None
        if not all(n.normalization == "RMSNorm" and n.invariant_rms and n.offer_to is None for n in (qn, kn)):
            return None
        if qn.eps != kn.eps or qn.zero_centered_gamma != kn.zero_centered_gamma or not fused_ops.norm_fuses(self.fused, qn.weight.device):
            return None
        return qn.weight, kn.weight, qn.eps, qn.zero_centered_gamma

    def _fused_qk(self, mixed: torch.Tensor, rope) -> bool:
        c = self.attn.config
        return (fused_ops.use_kernels(self.fused, "qk_norm_rope_cache") and mixed.dtype in (torch.bfloat16, torch.float16)
                and self._qk_norms() is not None and self.hn <= 4096
                and (rope is None or (not c.rotary_interleaved and not c.apply_rope_fusion
                                      and not c.multi_latent_attention and getattr(c, "mrope_section", None) is None)))

    def _attend(self, x, rope, hidden, rows, positions, cache: KVCache, fire: bool):
        attn = self.attn
        mixed, bias = self.qkv(x, fire)
        if bias is not None:
            mixed = mixed + bias
        kc, vc = cache.view(self.index, x.shape[1])
        b = x.shape[1]
        if not fire and self._fused_qk(mixed, rope):
            wq, wk, eps, zc = self._qk_norms()
            cos, sin = (None, None) if rope is None else rope.tables(mixed.dtype, attn._yarn_concentration_factor)
            q = self.fused.qk_norm_rope_cache(mixed.view(b, -1), wq, wk, eps, zc, cos, sin, positions, kc, vc,
                self.ng, self.np // self.ng).view(1, b, self.np, self.hn)
        else:
            q, k, v = self.split(mixed)
            if rope is not None:
                freqs = rope.freqs
                mscale = attn._yarn_concentration_factor
                q = apply_rotary_pos_emb(q, freqs, config=attn.config, cu_seqlens=None, mscale=mscale, cp_group=attn.pg_collection.cp)
                k = apply_rotary_pos_emb(k, freqs, config=attn.config, cu_seqlens=None, mscale=mscale, cp_group=attn.pg_collection.cp)
            kc.index_put_((positions, rows), k[0].to(kc.dtype))
            vc.index_put_((positions, rows), v[0].to(vc.dtype))
        if self.mode == "sdpa":
            ctx = torch.nn.functional.scaled_dot_product_attention(
                q.permute(1, 2, 0, 3), kc.permute(1, 2, 0, 3), vc.permute(1, 2, 0, 3), attn_mask=~hidden,
                scale=attn.config.softmax_scale or self.hn ** -0.5,
                enable_gqa=self.np != self.ng,
            )
            ctx = ctx.permute(2, 0, 1, 3).reshape(1, x.shape[1], -1)
        else:
            ctx = attn.core_attention(q, kc, vc, hidden, attn_mask_type=AttnMaskType.no_mask)
        return self.proj(ctx, fire)


class LayerStep:
    """One ``TransformerLayer``: the layer's norms and bias-dropout-adds around attention and MLP."""

    def __init__(self, index: int, layer, invariant: bool, weights: list, attention: str, fused, routing):
        self.layer = layer
        self.fused = fused
        self.attention = AttentionStep(index, layer.self_attention, invariant, weights, attention, fused)
        self.mlp = MoEStep(layer.mlp, invariant, weights, fused, routing) if isinstance(layer.mlp, MoELayer) else MLPStep(
            layer.mlp, invariant, weights)

    def __call__(self, h, pending, rope, hidden, rows, positions, cache, fire: bool = False):
        """``h`` the residual stream, ``pending`` the previous layer's MLP output and its
        bias-dropout-add not yet applied (None for the first layer) -> ``(h, pending)`` of this
        layer: each residual add is fused into the norm that follows it where
        :func:`add_then_norm` can (one kernel), else run as the learner runs it."""
        layer = self.layer
        fusion = layer.config.bias_dropout_fusion
        if pending is None:
            x = layer.input_layernorm(h)
        else:
            h, x, _ = add_then_norm(layer.input_layernorm, h, pending, fire, self.fused)
        out = self.attention(x, rope, hidden, rows, positions, cache, fire)
        moe = isinstance(self.mlp, MoEStep)  # the routed experts may take the norm's NVFP4 of their input
        h, x, qx = add_then_norm(layer.pre_mlp_layernorm, h, (out, self.bda("self_attn_bda")), fire, self.fused,
                                 self.mlp.input_ctx(h.device) if moe else None)
        return h, (self.mlp(x, fire, qx) if moe else self.mlp(x, fire), self.bda("mlp_bda"))

    def bda(self, name: str):
        """The layer's bias-dropout-add ``name`` as ``fn(out_with_bias, residual)``; ``fn.plain``:
        it is a plain ``residual + out`` (no bias, no active dropout)."""
        layer = self.layer
        fn = getattr(layer, name)(layer.training, layer.config.bias_dropout_fusion)

        def apply(out, residual):
            return fn(out, residual, layer.hidden_dropout)

        apply.plain = not (layer.training and layer.hidden_dropout)
        return apply


def add_then_norm(norm, residual: torch.Tensor, pending, fire: bool, fused, consumer=None):
    """``(h, norm(h), q)`` for ``h = bda(out, residual)``, ``pending = ((out, bias), bda)``; ``fused``:
    the backend of the fused decode kernels (:func:`.fused_ops.fused_backend`) or None; ``q``: with
    ``consumer`` (the ``LinearContext`` of an NVFP4 linear that reads ``norm(h)``'s rows, e.g. the
    routed experts' fc1), the kernel's NVFP4 of ``norm(h)`` where it is what that linear's
    quantizer gives (the conditions of a producer's handoff), else None.

    One kernel (``minite_kernels.triton.nvfp4.norm_quantize.add_rmsnorm_quantize``: ``h`` bitwise torch's
    add, ``norm(h)`` bitwise ``bi_rmsnorm``) where the norm is the batch-invariant RMSNorm the
    learner computes with ``bi_rmsnorm`` -- an input norm whose NVFP4 quantization goes to the
    next linear (the handoff gets it, as from the learner's fused producer) or a strict / aligned
    ``MiniteNorm`` -- the add is plain and ``fused`` has the kernel (:func:`.fused_ops.use_kernels`);
    else the learner's bias-dropout-add and the norm module."""
    (out, bias), bda = pending
    done = None if (fire or bias is not None or not bda.plain) else _fused_add_norm(norm, residual, out, fused, consumer)
    if done is not None:
        return done
    h = bda((materialized(out), bias), residual)
    return h, norm(h), None


def materialized(out):
    """An MLP output as a tensor (a :class:`CombinedRows` combined)."""
    return out.tensor() if isinstance(out, CombinedRows) else out


def _quantizes_for(recipe, out: torch.Tensor):
    """The backend whose fused RMSNorm -> NVFP4 producer gives, for ``out``'s rows, what an NVFP4
    linear of ``recipe`` quantizes (a handoff's conditions), else None."""
    from ..ops.producers import fused_supported

    backend = backend_for(recipe, out.device)
    if recipe.nonfinite != "propagate" or not fused_supported("rmsnorm_quantize", out, recipe, backend):
        return None
    return backend


def _fused_add_norm(norm, residual: torch.Tensor, out: torch.Tensor, fused, consumer=None):
    from ..modules.norm import MiniteNorm

    if not (fused_ops.use_kernels(fused, "add_rmsnorm_quantize") and out.dtype in (torch.bfloat16, torch.float16) and residual.dtype == out.dtype
            and isinstance(norm, MiniteNorm) and norm.normalization == "RMSNorm" and out.shape[-1] % 16 == 0
            and residual.shape == out.shape):
        return None
    slot = norm.offer_to
    if slot is not None:  # the learner's fused producer (rmsnorm_quantize), offering its quantization
        backend = _quantizes_for(slot.recipe, out)
        if backend is None:
            return None
    elif not (norm.invariant_rms and fused_ops.norm_fuses(fused, out.device)):
        return None  # not bi_rmsnorm's arithmetic in the learner
    shape, hdim = out.shape, out.shape[-1]
    # a CombinedRows: the MoE combine in the same kernel, before the add
    rows, combine = (out.rows, out.combine) if isinstance(out, CombinedRows) else (out.reshape(-1, hdim), None)
    h, y, q = fused.add_rmsnorm_quantize(residual.reshape(-1, hdim), rows, norm.weight, norm.eps,
                                         norm.zero_centered_gamma, with_image=True, combine=combine)
    if slot is not None:
        slot.offer(y, q, activation_key(slot.recipe, backend))
    handed = consumer is not None and _quantizes_for(consumer.recipe, out) is not None
    return h.view(shape), y.view(shape), q if handed else None


class DecodeModel:
    """The decode step and the prefill of a ``GPTModel`` (see the module docstring).

    Args:
        model: the learner's model (support checked by :func:`.support.fast_path_refusal`).
        attention: ``"module"`` (the layers' own ``core_attention``) or ``"sdpa"``.
        invariant_gemm: decode GEMMs in the learner's accumulation order in default mode too.
        fused_kernels: the fused decode kernels (:mod:`.fused_ops`) where their backend has them;
            False: none -- the learner's modules and the ops' torch references, the same bits
            (tests and ``benchmarks.rollout`` compare the two).
        kernels_on_cpu: on a CPU model, the fused kernels of the Triton backend under
            ``TRITON_INTERPRET=1`` (:func:`~minite_megatron.nvfp4.backends.kernel_backend`; tests and
            ``benchmarks.kernels._decode_count``); else a CPU runs the references.
    """

    def __init__(self, model: torch.nn.Module, *, attention: str = "module", invariant_gemm: bool = False,
                 fused_kernels: bool = True, kernels_on_cpu: bool = False):
        if attention not in ("module", "sdpa"):
            raise ValueError(f"attention must be 'module' or 'sdpa', got {attention!r}")
        self.gpt = gpt = unwrap_gpt(model)
        from .resident import is_resident

        device = gpt.embedding.word_embeddings.weight.device
        # the backend whose fused kernels run (None: fused_kernels=False), and the recipe-less ops'
        # backend, whose moe_route limits pick the MoE layer's path either way
        self.fused = fused_ops.fused_backend(device, fused_kernels=fused_kernels, kernels_on_cpu=kernels_on_cpu)
        self.routing = kernel_backend(device, kernels_on_cpu)
        self.weights = DecodeWeights(alias=is_resident(gpt))
        self.layers = [LayerStep(i, layer, invariant_gemm, self.weights, attention, self.fused, self.routing)
                       for i, layer in enumerate(gpt.decoder.layers)]
        attn = gpt.decoder.layers[0].self_attention
        self.groups, self.head_dim = attn.num_query_groups_per_partition, attn.hidden_size_per_attention_head
        self._rope_table: dict[int, torch.Tensor] = {}
        self._rope_cs: dict = {}
        # a GlobalMemoryBuffer of our own while capturing: Megatron's DotProductAttention takes its
        # score buffer from the global one, which the learner may reallocate later
        self.graph_memory = GlobalMemoryBuffer()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def refresh_weights(self) -> int:
        """Copy new weight versions into the fixed-address buffers; returns how many changed."""
        return sum(w.refresh() for w in self.weights)

    def rope(self, max_seq: int) -> torch.Tensor | None:
        """Megatron's RoPE table ``[S, 1, 1, D]`` (None without RoPE)."""
        if self.gpt.position_embedding_type != "rope":
            return None
        if max_seq not in self._rope_table:
            self._rope_table[max_seq] = self.gpt.rotary_pos_emb(max_seq)
        return self._rope_table[max_seq]

    def rope_tables(self, max_seq: int, dtype: torch.dtype, mscale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[S, ROT]`` of :meth:`rope`'s table, Megatron's per-call values
        (:func:`.fused_ops.rope_tables`), computed once (before any graph capture reads them)."""
        key = (max_seq, dtype, float(mscale))
        if key not in self._rope_cs:
            self._rope_cs[key] = fused_ops.rope_tables(self.rope(max_seq), mscale, dtype)
        return self._rope_cs[key]

    @contextlib.contextmanager
    def capturing(self):
        """While warming up and capturing a graph: Megatron's global memory buffer is this runner's
        own, and its CUDA RNG tracker's ``fork`` (which ``DotProductAttention`` enters around its
        attention dropout, an identity at inference) does not read the generator state, which a
        capture forbids. After, the producers' handoff slots are cleared (offers in graph memory)."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        saved = parallel_state._GLOBAL_MEMORY_BUFFER
        parallel_state._GLOBAL_MEMORY_BUFFER = self.graph_memory
        tracker = get_cuda_rng_tracker()
        had_own = "fork" in vars(tracker)
        tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
        try:
            yield
        finally:
            parallel_state._GLOBAL_MEMORY_BUFFER = saved
            clear_all(self.gpt)
            if not had_own:
                del tracker.fork

    # ---- prefill ------------------------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor, cache: KVCache, bucket: int | None = None) -> torch.Tensor:
        """The learner's forward over ``tokens`` ``[B, L]`` (right-padded prompts) that also fills
        positions ``0..L-1`` of the cache's first ``B`` rows, laid out for ``bucket >= B`` rows
        (default ``B``); returns the logits ``[B, L, V]``."""
        from .logprobs import causal_mask

        b, length = tokens.shape
        handles = []
        for i, layer in enumerate(self.gpt.decoder.layers):
            kc, vc = cache.view(i, bucket or b)

            def hook(module, args, kc=kc, vc=vc):
                key, value = args[1], args[2]  # [L, B, ng, hn], after RoPE
                kc[: key.shape[0], : key.shape[1]].copy_(key)
                vc[: value.shape[0], : value.shape[1]].copy_(value)

            handles.append(layer.self_attention.core_attention.register_forward_pre_hook(hook))
        try:
            position_ids = torch.arange(length, device=tokens.device).unsqueeze(0).expand(b, length)
            return self.gpt(tokens, position_ids, causal_mask(length, device=tokens.device), runtime_gather_output=True)
        finally:
            for h in handles:
                h.remove()

    # ---- decode -------------------------------------------------------------------------------
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, fire_hooks: bool = False) -> torch.Tensor:
        """Logits ``[B, V]`` for ``tokens`` ``[B]`` (int64) at ``positions`` ``[B]`` (their keys and
        values written into the cache there); no host sync (except with ``fire_hooks``: the
        modules' forward hooks run as in a module call, for a diagnostics tracer)."""
        gpt = self.gpt
        b = tokens.shape[0]
        h = gpt.embedding(input_ids=tokens.view(b, 1), position_ids=positions.view(b, 1))  # [1, B, H]
        rope = None if self.rope(cache.max_seq) is None else _StepRope(self, cache.max_seq, positions)
        keys = torch.arange(cache.max_seq, device=tokens.device)
        hidden = (keys.view(1, -1) > positions.view(-1, 1)).view(b, 1, 1, -1)  # True = after the row's position
        rows = torch.arange(b, device=tokens.device)
        pending = None
        for layer in self.layers:
            h, pending = layer(h, pending, rope, hidden, rows, positions, cache, fire_hooks)
        if gpt.decoder.final_layernorm is not None:
            h = add_then_norm(gpt.decoder.final_layernorm, h, pending, fire_hooks, self.fused)[1]
        else:
            (out, bias), bda = pending
            h = bda((materialized(out), bias), h)
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        logits, _ = gpt.output_layer(h, weight=weight, runtime_gather_output=True)
        logits = gpt._scale_logits(logits)
        return logits[0]


class _StepRope:
    """RoPE of one decode step: Megatron's frequency rows at the step's positions (made on first
    use, for the unfused path) or the cos / sin tables (the fused q/k kernel reads them per position)."""

    def __init__(self, model: DecodeModel, max_seq: int, positions: torch.Tensor):
        self.model, self.max_seq, self.positions = model, max_seq, positions
        self._freqs = None

    @property
    def freqs(self) -> torch.Tensor:
        if self._freqs is None:
            b = self.positions.shape[0]
            self._freqs = self.model.rope(self.max_seq).index_select(0, self.positions).view(1, b, 1, -1)
        return self._freqs

    def tables(self, dtype: torch.dtype, mscale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.rope_tables(self.max_seq, dtype, mscale)
