"""A tiny W4A4 MoE transformer in pure torch, run two ways, for the tracer's unit tests.

Not a product: a test fixture whose two execution modes process tokens as a learner and a
rollout engine do, so that the tracer's keying and "first divergence" logic can be tested
without Megatron:

- ``run_learner``: whole (padded) sequences at once, a ``[s, b]`` token grid;
- ``run_rollout``: continuous batching: sequences enter at different steps, a prefill of the
  prompt, then one token per sequence per step, batches of changing composition, flattened
  ``[tokens]`` grids, KV cache, and expert rows in another order.

Every linear layer follows the NVFP4 contract (weights 16x16 tiles + tensor scale, activations
1x16 + per-token scale, :func:`gemm_reference`), and attention is computed per query token, so
both modes give bitwise-identical results token by token: any difference is a planted one.

Knobs (one per planted divergence): ``router_dtype`` (fp32 or bf16 router logits),
``attn_reverse`` (accumulate P @ V over keys in reverse order), ``sr_fc2_layer`` (stochastic
instead of nearest rounding in that layer's fc2 activation quantizer).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from minite_megatron.diagnostics import capture, capture_routed
from minite_megatron.nvfp4 import gemm_reference, quantize_reference


@dataclass
class TinyConfig:
    vocab: int = 48
    hidden: int = 32
    heads: int = 2
    head_dim: int = 16
    layers: int = 2
    experts: int = 4
    topk: int = 2
    ffn: int = 32


@dataclass
class Knobs:
    router_dtype: torch.dtype = torch.float32
    attn_reverse: bool = False
    sr_fc2_layer: int | None = None


def make_weights(cfg: TinyConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    p = {"embed": w(cfg.vocab, cfg.hidden, scale=1.0), "head": w(cfg.vocab, cfg.hidden)}
    for i in range(cfg.layers):
        p[f"{i}.qkv"] = w(3 * cfg.heads * cfg.head_dim, cfg.hidden)
        p[f"{i}.proj"] = w(cfg.hidden, cfg.heads * cfg.head_dim)
        p[f"{i}.router"] = w(cfg.experts, cfg.hidden, scale=1.0)
        for e in range(cfg.experts):
            p[f"{i}.fc1.{e}"] = w(2 * cfg.ffn, cfg.hidden)
            p[f"{i}.fc2.{e}"] = w(cfg.hidden, cfg.ffn)
    return p


class TinyMoE:
    def __init__(self, cfg: TinyConfig, weights: dict[str, torch.Tensor], knobs: Knobs | None = None):
        self.cfg, self.knobs = cfg, knobs or Knobs()
        self.w = weights
        self.qw = {
            k: quantize_reference(v, global_scale="tensor", tile=(16, 16))
            for k, v in weights.items()
            if "." in k and k.split(".")[1] in ("qkv", "proj", "fc1", "fc2")
        }

    # ---- ops (all row-wise: a token's result never depends on its batch) ---------------------
    @staticmethod
    def _rowdot(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` as an elementwise product and a reduction over K: the same per row
        whatever the number of rows (a BLAS GEMM may change its kernel with M)."""
        return (x.unsqueeze(-2) * w).sum(-1)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def _linear(self, x: torch.Tensor, wkey: str, name: str | None = None, routed=None, rounding="nearest"):
        qx = quantize_reference(x, global_scale="row", tile=(1, 16), rounding=rounding, seed=1234 if rounding == "stochastic" else None)
        if name is not None:
            if routed is None:
                capture(f"{name}.input_codes", qx.codes)
                capture(f"{name}.input_scales", qx.block_scales)
            else:
                capture_routed(f"{name}.input_codes", qx.codes, *routed)
                capture_routed(f"{name}.input_scales", qx.block_scales, *routed)
        return gemm_reference(qx, self.qw[wkey], out_dtype=torch.float32)

    def _layer(self, i: int, h: torch.Tensor, keys: list[tuple[int, int]], cache: dict, order_desc: bool):
        cfg, pre = self.cfg, f"decoder.layers.{i}"
        x = self._norm(h)
        capture(f"{pre}.input_layernorm.output", x)
        qkv = self._linear(x, f"{i}.qkv", f"{pre}.self_attention.linear_qkv")
        capture(f"{pre}.self_attention.linear_qkv.output", qkv)
        hd = cfg.heads * cfg.head_dim
        q, k, v = qkv[:, :hd], qkv[:, hd : 2 * hd], qkv[:, 2 * hd :]
        for t, key in enumerate(keys):  # KV cache first: a token attends to itself
            cache.setdefault((i, key[0]), {})[key[1]] = (k[t], v[t])
        ctx = torch.empty(len(keys), hd)
        for t, (s, pos) in enumerate(keys):
            kv = cache[(i, s)]
            ks = torch.stack([kv[j][0] for j in range(pos + 1)])
            vs = torch.stack([kv[j][1] for j in range(pos + 1)])
            for hh in range(cfg.heads):
                sl = slice(hh * cfg.head_dim, (hh + 1) * cfg.head_dim)
                sc = (ks[:, sl] * q[t, sl]).sum(-1) / cfg.head_dim**0.5
                pr = torch.softmax(sc, dim=0)
                acc = torch.zeros(cfg.head_dim)
                order = range(pos, -1, -1) if self.knobs.attn_reverse else range(pos + 1)
                for j in order:
                    acc = acc + pr[j] * vs[j, sl]
                ctx[t, sl] = acc
        capture(f"{pre}.self_attention.core_attention.output", ctx)
        o = self._linear(ctx, f"{i}.proj", f"{pre}.self_attention.linear_proj")
        capture(f"{pre}.self_attention.linear_proj.output", o)
        h = h + o

        x = self._norm(h)
        capture(f"{pre}.pre_mlp_layernorm.output", x)
        rd = self.knobs.router_dtype
        logits = self._rowdot(x.to(rd), self.w[f"{i}.router"].to(rd)).float()
        capture(f"{pre}.mlp.router.logits", logits)
        top = torch.topk(logits, cfg.topk, dim=-1)
        capture(f"{pre}.mlp.router.topk", top.indices.sort(dim=-1).values)
        probs = torch.softmax(top.values, dim=-1)
        out = torch.zeros_like(h)
        for e in range(cfg.experts):
            rows = (top.indices == e).any(-1).nonzero().reshape(-1)
            if order_desc:
                rows = rows.flip(0)
            if rows.numel() == 0:
                continue
            routed = (rows, torch.full_like(rows, e))
            f1 = self._linear(x[rows], f"{i}.fc1.{e}", f"{pre}.mlp.experts.linear_fc1", routed)
            capture_routed(f"{pre}.mlp.experts.linear_fc1.output", f1, *routed)
            act = torch.nn.functional.silu(f1[:, : cfg.ffn]) * f1[:, cfg.ffn :]
            rnd = "stochastic" if self.knobs.sr_fc2_layer == i else "nearest"
            f2 = self._linear(act, f"{i}.fc2.{e}", f"{pre}.mlp.experts.linear_fc2", routed, rounding=rnd)
            capture_routed(f"{pre}.mlp.experts.linear_fc2.output", f2, *routed)
            wgt = (probs * (top.indices == e)).sum(-1)[rows]
            out[rows] += wgt.unsqueeze(1) * f2
        capture(f"{pre}.mlp.output", out)
        return h + out

    def forward(self, tokens: torch.Tensor, keys: list[tuple[int, int]], cache: dict, order_desc=False):
        """tokens int64 [T] with their (seq, pos) keys -> fp32 logits [T, vocab]."""
        h = self.w["embed"][tokens]
        capture("embedding.output", h)
        for i in range(self.cfg.layers):
            h = self._layer(i, h, keys, cache, order_desc)
        x = self._norm(h)
        capture("decoder.final_layernorm.output", x)
        logits = self._rowdot(x, self.w["head"])
        capture("output_layer.output", logits)
        return logits


@contextlib.contextmanager
def one_thread():
    """Tiny ops on a shared 2-core machine run several times faster on one intra-op thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def run_learner(model: TinyMoE, seqs: list[torch.Tensor], tracer=None) -> list[torch.Tensor]:
    """Teacher-forced: one forward over a padded [s, b] grid. Returns per-seq log-probs of
    tokens 1..n-1 (given the prefix)."""
    b, s = len(seqs), max(len(x) for x in seqs)
    grid = torch.zeros(s, b, dtype=torch.long)
    for j, x in enumerate(seqs):
        grid[: len(x), j] = x
    seq_ids = torch.arange(b).view(1, b).expand(s, b)
    pos = torch.arange(s).view(s, 1).expand(s, b)
    if tracer is not None:
        tracer.set_tokens(seq_ids, pos)
    flat_keys = list(zip(seq_ids.reshape(-1).tolist(), pos.reshape(-1).tolist()))
    with one_thread():
        logits = model.forward(grid.reshape(-1), flat_keys, {}).view(s, b, -1)
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[: len(x) - 1, j].gather(-1, x[1:].unsqueeze(-1)).squeeze(-1) for j, x in enumerate(seqs)]


def run_rollout(model: TinyMoE, seqs: list[torch.Tensor], prompt_len: int, tracer=None) -> list[torch.Tensor]:
    """Continuous batching: sequence j enters at step j (prefill of ``prompt_len`` tokens),
    then decodes one (given) token per step; batches are flattened [tokens] grids, the newest
    sequence first, expert rows in descending token order. Returns the same log-probs as
    :func:`run_learner` (positions prompt_len-1 .. n-2 come from decode steps)."""
    n = len(seqs)
    cache: dict = {}
    out = [torch.empty(len(x) - 1) for x in seqs]
    nxt = [0] * n  # next position to feed
    step = 0
    while any(nxt[j] < len(seqs[j]) - 1 for j in range(n)):
        toks, keys = [], []
        for j in reversed(range(n)):
            if j > step or nxt[j] >= len(seqs[j]) - 1:
                continue
            cnt = prompt_len if nxt[j] == 0 else 1
            for p in range(nxt[j], nxt[j] + cnt):
                toks.append(int(seqs[j][p]))
                keys.append((j, p))
            nxt[j] += cnt
        step += 1
        if not toks:
            continue
        if tracer is not None:
            tracer.set_tokens(torch.tensor([k[0] for k in keys]), torch.tensor([k[1] for k in keys]))
        with one_thread():
            logits = model.forward(torch.tensor(toks), keys, cache, order_desc=True)
        logp = torch.log_softmax(logits, dim=-1)
        for t, (j, p) in enumerate(keys):
            if p + 1 < len(seqs[j]):
                out[j][p] = logp[t, seqs[j][p + 1]]
    return out


def make_sequences(cfg: TinyConfig, lengths=(9, 7, 8), seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab, (n,), generator=g) for n in lengths]
