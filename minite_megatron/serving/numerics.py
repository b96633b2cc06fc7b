"""The learner's forward, as functions of the exported tensors (what a serving plugin must compute).

Every function here is built from the learner's own pieces, so an engine that calls them computes
what the learner computes (strict mode: bit for bit, see ``docs/serving.md`` for what the engine
itself still computes its own way):

- :func:`nvfp4_linear`: ``y = gemm(quantize(x, per token, 1x16), W)`` with the contract's chain and
  epilogue (``alpha[m] = S_dec_x[m] * weight_scale_2``, bias in fp32, one bf16 rounding), on the
  exported weight bytes (:func:`weight_view`; never re-quantized). This is
  :class:`minite_megatron.ops.linear.NVFP4LinearFunction`'s forward.
- :func:`high_precision_linear`: the router and the LM head: FP32 logits from the BF16 operands
  (the batch-invariant strict GEMM in strict mode, else ``x.float() @ W.float().T``), as
  ``StrictTopKRouter.gating`` / Megatron's fp32 router and ``FP32OutputLayer`` do.
- :func:`moe_forward`: the MoE block of the learner's spec (``StrictMoELayer`` / ``MoELayer`` +
  ``TEGroupedMLP`` with NVFP4 grouped experts): the learner's top-k routing on FP32 logits
  (:func:`route`: strict or Megatron's), tokens permuted expert-major, fc1 per token
  quantized, the GLU activation of :class:`~minite_megatron.modules.activation.MiniteActivation`,
  the router probability applied in fp32 and rounded to bf16 (Megatron's ``bias_act_func``), fc2,
  and :func:`~minite_megatron.modules.deterministic_moe.deterministic_unpermute` (experts added in increasing
  index order).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch

from .. import nvfp4
from ..nvfp4 import BLOCK, NVFP4Tensor


def weight_view(codes: torch.Tensor, scales: torch.Tensor, scale_2: torch.Tensor,
                piece_rows: Sequence[int] | None = None, tile: tuple[int, int] = (BLOCK, BLOCK)) -> NVFP4Tensor:
    """An :class:`NVFP4Tensor` over exported weight bytes (a view: no copy, no re-quantization).

    Args:
        codes: uint8 ``[N, K/2]``; scales: float8_e4m3fn ``[N, K/16]`` (``weight`` /
            ``weight_scale``); scale_2: fp32 ``[P]`` (``weight_scale_2``, one per fused piece).
        piece_rows: rows of each fused piece (``sum == N``); None for one piece.
    Returns:
        a ``"tensor"``-scaled tensor when all pieces share one ``weight_scale_2`` (the learner's
        fused weight), else ``"row"``-scaled with each piece's scale on its rows (exact per piece).
    Raises:
        ValueError for dtypes or shapes that are not the ModelOpt NVFP4 layout.
    """
    if codes.dtype != torch.uint8 or scales.dtype != torch.float8_e4m3fn or codes.dim() != 2:
        raise ValueError(f"weight_view: need uint8 [N, K/2] codes and e4m3 [N, K/16] scales, got {codes.dtype} "
                         f"{tuple(codes.shape)} and {scales.dtype} {tuple(scales.shape)}")
    n, k = codes.shape[0], codes.shape[1] * 2
    if tuple(scales.shape) != (n, k // BLOCK):
        raise ValueError(f"weight_view: scales {tuple(scales.shape)} do not match codes {tuple(codes.shape)}")
    s2 = scale_2.reshape(-1).to(torch.float32)
    pieces = list(piece_rows) if piece_rows is not None else [n]
    if sum(pieces) != n or len(pieces) != s2.numel():
        raise ValueError(f"weight_view: {s2.numel()} weight_scale_2 values for pieces {pieces} of {n} rows")
    if s2.numel() == 1 or bool((s2 == s2[0]).all()):
        return NVFP4Tensor(codes, scales, s2[:1], torch.Size([n, k]), "tensor", tile)
    rows = torch.repeat_interleave(s2, torch.tensor(pieces, device=s2.device))
    return NVFP4Tensor(codes, scales, rows, torch.Size([n, k]), "row", (1, BLOCK))


def quantize_tokens(x2: torch.Tensor, backend, amax: torch.Tensor | None = None) -> NVFP4Tensor:
    """Per-token 1x16 quantization of ``[M, K]`` activations: the learner's ``quantize_activation``."""
    return backend.quantize(x2, global_scale="row", amax=amax, with_image=True, nonfinite="propagate")


def nvfp4_linear(x: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None = None, *, backend=None,
                 strict: bool = False) -> torch.Tensor:
    """``x [..., K]`` (bf16) times the NVFP4 weight ``[N, K]`` -> ``[..., N]`` in ``x.dtype``.

    ``backend``: an NVFP4 backend object or name (None: the best for ``x.device``, as
    :func:`minite_megatron.nvfp4.get_backend`); ``strict`` asks for the batch-invariant GEMM.
    """
    be = backend if backend is not None and not isinstance(backend, str) else nvfp4.get_backend(backend, x.device)
    x2 = x.reshape(-1, x.shape[-1])
    y = be.gemm(quantize_tokens(x2, be), w, bias, out_dtype=x.dtype, batch_invariant=strict)
    return y.reshape(*x.shape[:-1], w.shape[0])


def high_precision_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                          strict: bool = False, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP32 router / LM-head logits (or a BF16 layer with ``out_dtype=bf16``), as the learner runs them."""
    if strict:
        from ..invariant.matmul import linear

        return linear(x, weight, bias, out_dtype=out_dtype)
    if out_dtype != torch.float32:
        return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype)).to(out_dtype)
    out = torch.matmul(x.float(), weight.float().t())
    return out + bias.float() if bias is not None else out


def glu_activation(h: torch.Tensor, strict: bool) -> torch.Tensor:
    """SwiGLU of the expert fc1 output ``[P, 2F]``: :class:`MiniteActivation`'s computation with the
    recipe's ``activation_func`` (strict mode: the position-invariant fp32 SiLU)."""
    from ..modules.activation import MiniteActivation

    if strict:
        from ..invariant.activations import silu
    else:
        silu = torch.nn.functional.silu
    cfg = SimpleNamespace(gated_linear_unit=True, activation_func=silu, activation_func_clamp_value=None,
                          glu_linear_offset=0.0, tensor_model_parallel_size=1)
    return MiniteActivation(cfg).activation(h)


def route(logits: torch.Tensor, topk: int, renormalize: bool, strict: bool = False,
          invariant: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's top-k on FP32 logits ``[T, E]`` -> ``(probs [T, E] fp32, routing_map bool)``.

    ``renormalize`` (HF ``norm_topk_prob``) is Megatron's softmax over the selected k
    (``moe_router_pre_softmax=False``); without it, softmax over all experts then top-k.

    Strict mode, and default mode with the recipe's ``aligned_ops`` (``invariant``, default: ``strict``):
    :func:`~minite_megatron.modules.router.topk_routing` (``StrictTopKRouter`` / ``AlignedTopKRouter``:
    stable top-k, the fixed-order softmax). Default mode without aligned ops: Megatron's ``topk_routing_with_score_function``
    (``TopKRouter``: ``torch.topk`` and ``torch.softmax``) with the experts of a *sorted*
    ``torch.topk``, i.e. the learner's training forward. Megatron itself sorts the top-k only
    while grad is enabled (``sorted=torch.is_grad_enabled()``), and the softmax over the k
    selected logits sums them in that order: with ``topk >= 3`` the learner's own no-grad forward
    can differ from its training forward in the last bits of the probabilities
    (``docs/serving.md``). The plugin serves the training forward's bits."""
    logits = logits.float()
    if strict if invariant is None else invariant:
        from ..modules.router import topk_routing

        return topk_routing(logits, topk, score_function="softmax", use_pre_softmax=not renormalize,
                            check_finite=strict)
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    scores = logits if renormalize else torch.softmax(logits, dim=-1, dtype=torch.float32)
    chosen = torch.topk(scores, k=topk, dim=1, sorted=True).indices
    return topk_routing_with_score_function(logits, topk, use_pre_softmax=not renormalize, score_function="softmax",
                                            precomputed_indices=chosen)


def moe_expert_rows(x: torch.Tensor, logits: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, *, topk: int,
                    renormalize: bool = True, strict: bool = False, backend=None,
                    invariant_routing: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' outputs before the combine: ``(rows [P, H] in x.dtype, token_of [P])``.

    ``P = T * topk`` rows in Megatron's permuted order (expert-major, tokens increasing inside an
    expert), each the fc2 output of one (token, expert) pair with the router probability applied
    to the activation: what Megatron's ``TEGroupedMLP`` returns to the token dispatcher.
    Args / raises: as :func:`moe_forward`.
    """
    be = backend if backend is not None and not isinstance(backend, str) else nvfp4.get_backend(backend, x.device)
    experts = logits.shape[1]
    if w13.global_scale != "group" or w2.global_scale != "group" or w13.shape[0] != experts or w2.shape[0] != experts:
        raise ValueError(f"moe_forward: need [E, ., .] group-scaled experts for {experts} experts, got "
                         f"{tuple(w13.shape)} / {tuple(w2.shape)}")
    # a token with NaN router logits (garbage hidden states, e.g. vLLM's profiling forward over
    # uninitialized attention output) is routed as if its logits were 0 and its rows are NaN: the
    # NaN stays visible and no other token changes (the learner's strict router raises instead)
    bad = torch.isnan(logits).any(dim=1)
    if bool(bad.any()):
        logits = torch.where(bad[:, None], torch.zeros_like(logits), logits)
    probs, routing_map = route(logits, topk, renormalize, strict, invariant_routing)
    # Megatron's permute: expert-major, tokens in increasing order inside an expert
    expert_of, token_of = routing_map.t().nonzero(as_tuple=True)
    permuted_probs = probs.t()[expert_of, token_of]
    group_sizes = routing_map.sum(0).tolist()
    h = be.grouped_gemm(quantize_tokens(x[token_of], be), w13, group_sizes, None, x.dtype, strict)
    act = glu_activation(h, strict)
    inter = (act * permuted_probs.unsqueeze(-1)).to(act.dtype)
    rows = be.grouped_gemm(quantize_tokens(inter, be), w2, group_sizes, None, x.dtype, strict)
    if bool(bad.any()):
        rows = torch.where(bad[token_of][:, None], torch.full_like(rows, float("nan")), rows)
    return rows, token_of


def moe_forward(x: torch.Tensor, logits: torch.Tensor, w13: NVFP4Tensor, w2: NVFP4Tensor, *, topk: int,
                renormalize: bool = True, strict: bool = False, backend=None,
                invariant_routing: bool | None = None) -> torch.Tensor:
    """The learner's MoE block (module docstring) on ``x [T, H]`` bf16 with FP32 ``logits [T, E]``.

    The combine is :func:`~minite_megatron.modules.deterministic_moe.deterministic_unpermute` (a token's rows
    added in increasing expert order, one bf16 rounding per add) in both modes: strict mode's
    ``StrictMoELayer`` combine. Megatron's own ``MoELayer`` (the default-mode layer on ``main``)
    combines with ``scatter_add_`` instead: on a CPU an fp32 sum rounded once to bf16, on a GPU bf16
    atomics in arrival order (``docs/serving.md``).

    Args:
        w13: ``[E, 2F, H]`` NVFP4, ``"group"`` scales (each expert's gate/up with one global scale);
        w2: ``[E, H, F]`` NVFP4, ``"group"`` scales.
        invariant_routing: strict routing's top-k and softmax (default: ``strict``; the recipe's
            ``aligned_ops`` gives default mode that router, :func:`route`).
    Returns:
        ``[T, H]`` in ``x.dtype``.
    Non-finite input: a token whose router logits hold a NaN gets a NaN output row (the learner's
    strict router raises on it; a serving engine must not die on one request or on vLLM's
    profiling forward); the other tokens are unchanged.
    Raises:
        ValueError for mismatched shapes.
    """
    from ..modules.deterministic_moe import deterministic_unpermute

    rows, token_of = moe_expert_rows(x, logits, w13, w2, topk=topk, renormalize=renormalize, strict=strict,
                                     backend=backend, invariant_routing=invariant_routing)
    return deterministic_unpermute(rows, token_of, logits.shape[0])




# ---- the rest of the learner's layer: norms with the residual add, RoPE, attention, log-probs ------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, invariant: bool) -> torch.Tensor:
    """:class:`~minite_megatron.modules.norm.MiniteNorm`'s RMSNorm (``zero_centered_gamma`` off, as
    the Qwen3 export writes): the batch-invariant formulation (strict mode, or default mode with the
    recipe's ``aligned_ops``), else ``F.rms_norm`` on operands of one dtype."""
    if invariant:
        from ..invariant.rmsnorm import rms_norm as invariant_rms_norm

        return invariant_rms_norm(x, weight, eps, False)
    if x.dtype == weight.dtype:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(h), h)`` with ``h = residual + x`` in the stream's dtype: Megatron's bias-dropout-add
    (no bias, no dropout: one BF16 add) and then the next norm of the learner's layer. (vLLM's own
    ``fused_add_rms_norm`` normalises the fp32 sum before its BF16 rounding: issue 28.)"""
    h = residual + x
    return rms_norm(h, weight, eps, invariant), h


def rope_freqs(head_dim: int, theta: float, max_positions: int, device=None) -> torch.Tensor:
    """Megatron's RoPE table ``[S, 1, 1, D]`` fp32 (``RotaryEmbedding(kv_channels=D, rotary_percent=1,
    rotary_base=theta)(S)``, the learner's own module: every row is the same whatever ``S``)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_base=theta, use_cpu_initialization=True)
    return rope(max_positions).to(device) if device is not None else rope(max_positions)


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Megatron's unfused, non-interleaved RoPE (``_apply_rotary_pos_emb_bshd``: ``cos`` / ``sin`` of
    the fp32 table rounded to ``t``'s dtype, then ``t * cos + rotate_half(t) * sin`` in that dtype) on
    ``t`` ``[T, H, D]`` at ``positions`` ``[T]``."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[positions.long()], rotary_interleaved=False).squeeze(1)


def request_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, invariant: bool) -> torch.Tensor:
    """One request's causal attention: ``q`` ``[Sq, Hq, D]`` are the last ``Sq`` of the ``Sk`` positions
    of ``k`` / ``v`` ``[Sk, Hkv, D]`` (a prefill, a prefill chunk or decode steps) -> ``[Sq, Hq, D]``.

    ``invariant`` (strict mode, or the recipe's ``aligned_attention``): the learner's batch- and
    prefill/decode-invariant attention (:func:`minite_megatron.invariant.attention.attention`), so a
    query gets the bits of the learner's full-sequence forward; else torch SDPA with the same
    visibility (:func:`~minite_megatron.invariant.attention.sdpa_attention`, default mode's core attention)."""
    from ..invariant.attention import attention, sdpa_attention

    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    fn = attention if invariant else sdpa_attention
    return fn(qh, kh, vh, scale=scale, causal=True)[0].transpose(0, 1)


def logprobs_of_logits(logits: torch.Tensor, strict: bool) -> torch.Tensor:
    """fp32 ``log_softmax`` over the vocabulary as the learner scores a token
    (:func:`minite_megatron.rollout.logprobs.token_logprobs` at temperature 1): batch invariant in
    strict mode, else ``torch.log_softmax`` of the fp32 logits."""
    if strict:
        from ..invariant.softmax import log_softmax

        return log_softmax(logits, dim=-1)
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


__all__ = ["add_rms_norm", "apply_rope", "glu_activation", "high_precision_linear", "logprobs_of_logits", "moe_expert_rows",
           "moe_forward", "nvfp4_linear", "quantize_tokens", "request_attention", "rms_norm", "rope_freqs", "route",
           "weight_view"]
