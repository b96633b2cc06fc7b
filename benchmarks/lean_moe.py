"""The lean plain-torch BF16 anchor of ``benchmarks.learner_step``: not product code, a yardstick.

A Qwen3-MoE-shaped decoder written directly in torch, with nothing a framework adds: RMSNorm,
fused qkv, qk-RMSNorm, RoPE, SDPA causal attention with GQA (flash on the H200), fp32 router with
softmax top-k, tokens sorted by expert, experts through ``torch._grouped_mm`` (one launch for fc1
and one for fc2, device-side offsets from ``scatter_add_``: no host sync), SwiGLU, the
probability-weighted combine through ``index_add_``, an untied LM head and token cross-entropy.
Parameters in BF16 (experts as ``[E, N, K]`` tensors), autograd for the backward. It is what a
good BF16 implementation of the same shape costs on this machine.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE on ``x`` ``[B, H, S, D]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x`` [T, K] sorted by expert, ``w`` [E, N, K] -> [T, N]."""
    if x.is_cuda:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    sizes = counts.tolist()  # CPU smoke runs only
    return torch.cat([xe @ w[g].t() for g, xe in enumerate(torch.split(x, sizes))])


class LeanMoE(torch.nn.Module):
    def __init__(self, *, layers, hidden, heads, groups, head_dim, experts, topk, moe_ffn, vocab, max_seq,
                 device, dtype=torch.bfloat16, rope_base=1_000_000.0, std=0.02):
        super().__init__()
        self.h, self.nh, self.ng, self.d, self.e, self.k, self.f = hidden, heads, groups, head_dim, experts, topk, moe_ffn

        def p(*shape, scale=std):
            return torch.nn.Parameter(torch.randn(*shape, device=device, dtype=dtype) * scale)

        def ones(n):
            return torch.nn.Parameter(torch.ones(n, device=device, dtype=dtype))

        self.embed = p(vocab, hidden)
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            m = torch.nn.Module()
            m.n1, m.n2, m.qn, m.kn = ones(hidden), ones(hidden), ones(head_dim), ones(head_dim)
            m.qkv = p((heads + 2 * groups) * head_dim, hidden)
            m.o = p(hidden, heads * head_dim)
            m.router = p(experts, hidden)
            m.fc1 = p(experts, 2 * moe_ffn, hidden)
            m.fc2 = p(experts, hidden, moe_ffn)
            self.layers.append(m)
        self.norm = ones(hidden)
        self.head = p(vocab, hidden)
        inv = 1.0 / rope_base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
        ang = torch.outer(torch.arange(max_seq, device=device, dtype=torch.float32), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos().to(dtype), persistent=False)
        self.register_buffer("sin", ang.sin().to(dtype), persistent=False)

    def _attention(self, m, x):
        b, s, _ = x.shape
        qkv = F.linear(x, m.qkv).view(b, s, self.nh + 2 * self.ng, self.d)
        q, k, v = qkv.split([self.nh, self.ng, self.ng], dim=2)
        q = F.rms_norm(q, (self.d,), m.qn, 1e-6).transpose(1, 2)
        k = F.rms_norm(k, (self.d,), m.kn, 1e-6).transpose(1, 2)
        cos, sin = self.cos[:s], self.sin[:s]
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, scale=1 / math.sqrt(self.d),
                                           enable_gqa=True)
        return F.linear(o.transpose(1, 2).reshape(b, s, -1), m.o)

    def _moe(self, m, x):
        shape = x.shape
        x = x.reshape(-1, self.h)
        t = x.shape[0]
        logits = F.linear(x.float(), m.router.float())
        probs, idx = torch.topk(torch.softmax(logits, dim=-1), self.k, dim=-1)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.e, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat.int(), torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        token = order // self.k
        xs = x.index_select(0, token)
        h = _grouped(xs, m.fc1, offs, counts)
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up * probs.reshape(-1)[order, None].to(x.dtype)
        y = _grouped(a, m.fc2, offs, counts)
        return torch.zeros(t, self.h, device=x.device, dtype=x.dtype).index_add_(0, token, y).view(shape)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``tokens``/``labels`` [B, S] -> mean token cross-entropy."""
        x = F.embedding(tokens, self.embed)
        for m in self.layers:
            x = x + self._attention(m, F.rms_norm(x, (self.h,), m.n1, 1e-6))
            x = x + self._moe(m, F.rms_norm(x, (self.h,), m.n2, 1e-6))
        logits = F.linear(F.rms_norm(x, (self.h,), self.norm, 1e-6), self.head)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))
