"""The same ops, named alike, in the learner's forward and in vLLM's: what ``minite-diagnose vllm`` compares.

Both sides record into a :class:`~.capture.Tracer` under one set of names, each tensor in one
layout (tokens first, vLLM's ``q | k | v`` column order), so that
:func:`~.compare.compare_traces` can line them up by (sequence, position). Per decoder layer ``i``,
in execution order:

==============================  ========================================  ==============================================
name                            learner (Megatron GPT, minite spec)       vLLM (``Qwen3MoeForCausalLM``)
==============================  ========================================  ==============================================
``embedding``                   ``embedding``                             ``embed_tokens``
``layers.i.input_norm``         ``input_layernorm``                       ``input_layernorm`` (its norm output)
``layers.i.qkv``                ``linear_qkv`` (columns to q | k | v)     ``qkv_proj``
``layers.i.q_norm`` / k_norm    ``q_layernorm`` / ``k_layernorm``         ``q_norm`` / ``k_norm``
``layers.i.rope_q`` / rope_k    ``core_attention``'s query / key inputs   ``rotary_emb``'s outputs
``layers.i.attention``          ``core_attention``                        ``attn`` (on the paged KV cache)
``layers.i.o_proj``             ``linear_proj``                           ``o_proj``
``layers.i.attn_residual``      ``pre_mlp_layernorm``'s input             ``post_attention_layernorm``'s residual output
``layers.i.post_attn_norm``     ``pre_mlp_layernorm``                     ``post_attention_layernorm``'s norm output
``layers.i.router_logits``      ``router.gating``                         ``mlp.gate``
``layers.i.moe`` / ``mlp``      ``mlp`` (MoE block / dense MLP)           ``mlp``
``layers.i.mlp_residual``       the layer's output                        the next norm's residual output
``final_norm``                  ``decoder.final_layernorm``               ``model.norm``
``lm_head``                     ``output_layer`` (logits)                 ``logits_processor`` (logits)
``logprobs``                    the learner's log-softmax of the logits   ``compute_logits`` (minite: the learner's
                                (``rollout.logprobs.token_logprobs``)     log-probs, what vLLM's sampler reads)
==============================  ========================================  ==============================================

The learner runs one sequence per forward, teacher-forced (``[s, 1, ...]``). vLLM runs whatever its
scheduler forms; :class:`VllmOpHooks` keys each forward's tokens by the ``positions`` vLLM passes and
the sequence id the caller sets (``hooks.seq``, one request at a time). vLLM's logits are computed
only for the rows its sampler needs: they are keyed by matching each row of ``compute_logits``' input
to the forward's ``final_norm`` rows, bit for bit. The last sampled token is never fed back to vLLM,
so the comparison covers the positions both sides ran.

``stock_ops`` (:class:`VllmOpHooks`): ops the plugin replaces that vLLM then computes its own way
again, to see what each replacement is worth: ``"norm"`` (every ``RMSNorm`` and the fused residual
add + norm: vLLM's ``fused_add_rms_norm`` normalises the fp32 sum, the learner the BF16-rounded
one) and ``"rope"`` (vLLM's ``get_rope`` rotary embedding).
"""

from __future__ import annotations


import torch

from .capture import Tracer

OPS = ("input_norm", "qkv", "q_norm", "k_norm", "rope_q", "rope_k", "attention", "o_proj", "attn_residual",
       "post_attn_norm", "router_logits", "moe", "mlp", "mlp_residual")
"""The per-layer op names (``layers.{i}.{op}``), in execution order; then ``final_norm``, ``lm_head``, ``logprobs``."""

OP_DESCRIPTIONS = {
    "embedding": "the token embedding",
    "input_norm": "the layer's input RMSNorm; vLLM fuses it with the residual add from layer 1 on",
    "qkv": "the fused q/k/v projection",
    "q_norm": "the per-head q RMSNorm",
    "k_norm": "the per-head k RMSNorm",
    "rope_q": "q after the rotary embedding",
    "rope_k": "k after the rotary embedding",
    "attention": "the core attention (vLLM: on its paged KV cache)",
    "o_proj": "the attention output projection",
    "attn_residual": "the residual add after attention",
    "post_attn_norm": "the RMSNorm after the attention's residual add; vLLM fuses the two",
    "router_logits": "the router's logits",
    "moe": "the MoE block (routing, experts, combine)",
    "mlp": "the dense MLP",
    "mlp_residual": "the residual add after the MLP",
    "final_norm": "the final RMSNorm",
    "lm_head": "the LM head's logits",
    "logprobs": "the log-softmax over the vocabulary",
}

STOCK_OPS = ("norm", "rope")


def op_of(name: str) -> str:
    """``layers.3.post_attn_norm`` -> ``post_attn_norm``."""
    return name.rsplit(".", 1)[-1]


def _first(obj):
    return obj[0] if isinstance(obj, (tuple, list)) else obj


def _flat(t: torch.Tensor, lead: int) -> torch.Tensor:
    """``t`` with everything after its ``lead`` leading dims flattened into one."""
    return t.reshape(*t.shape[:lead], -1)


# ---- the learner --------------------------------------------------------------------------------
class LearnerOpHooks:
    """Hooks on a Megatron GPT (the minite spec, TP = 1) recording the ops of the module docstring.

    ``with LearnerOpHooks(tracer, gpt) as h: h.score(sequences)``: one teacher-forced forward per
    sequence (sequence id = its index), grad enabled (the learner's training forward, which strict
    mode and the RL learner use), returning each sequence's per-token log-probs."""

    def __init__(self, tracer: Tracer, gpt: torch.nn.Module):
        from ..export.rows import qkv_row_ranges

        self.tracer, self.gpt = tracer, gpt
        cfg = gpt.config
        r = qkv_row_ranges(cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads, cfg.kv_channels)
        self._qkv_cols = torch.cat([torch.arange(a, b) for p in "qkv" for a, b in r[p]])
        self._handles: list = []
        self._patched: list = []

    def _rec(self, name, t):
        self.tracer.record(name, _flat(t.detach(), 2))

    def _hook(self, name, pick=_first):
        return lambda mod, args, out: self._rec(name, pick(out))

    def __enter__(self) -> "LearnerOpHooks":
        from ..rollout.logprobs import model_is_strict

        g, add = self.gpt, self._handles.append
        strict = model_is_strict(g)
        add(g.embedding.register_forward_hook(self._hook("embedding")))
        for i, layer in enumerate(g.decoder.layers):
            p = f"layers.{i}."
            att = layer.self_attention
            add(layer.input_layernorm.register_forward_hook(self._hook(p + "input_norm")))
            add(att.linear_qkv.register_forward_hook(
                lambda m, a, o, p=p: self._rec(p + "qkv", _first(o)[..., self._qkv_cols.to(_first(o).device)])))
            add(att.q_layernorm.register_forward_hook(self._hook(p + "q_norm")))
            add(att.k_layernorm.register_forward_hook(self._hook(p + "k_norm")))

            def pre_core(m, args, p=p):
                self._rec(p + "rope_q", args[0])
                self._rec(p + "rope_k", args[1])

            add(att.core_attention.register_forward_pre_hook(pre_core))
            add(att.core_attention.register_forward_hook(self._hook(p + "attention")))
            add(att.linear_proj.register_forward_hook(self._hook(p + "o_proj")))
            add(layer.pre_mlp_layernorm.register_forward_pre_hook(lambda m, a, p=p: self._rec(p + "attn_residual", a[0])))
            add(layer.pre_mlp_layernorm.register_forward_hook(self._hook(p + "post_attn_norm")))
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                gating = router.gating

                def logged_gating(x, gating=gating, p=p):
                    logits = gating(x)
                    self.tracer.record(p + "router_logits", logits.detach())  # [s * b, E]: grid order
                    return logits

                router.gating = logged_gating
                self._patched.append(router)
            add(layer.mlp.register_forward_hook(self._hook(p + ("moe" if router is not None else "mlp"))))
            add(layer.register_forward_hook(self._hook(p + "mlp_residual")))
        add(g.decoder.final_layernorm.register_forward_hook(self._hook("final_norm")))

        def head(m, args, out):
            logits = _first(out).detach()
            self._rec("lm_head", logits)
            if strict:
                from ..invariant.softmax import log_softmax

                self._rec("logprobs", log_softmax(logits, dim=-1))
            else:
                self._rec("logprobs", torch.log_softmax(logits.to(torch.float32), dim=-1))

        add(g.output_layer.register_forward_hook(head))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        for router in self._patched:
            del router.gating  # back to the class's method
        self._handles, self._patched = [], []

    def score(self, sequences) -> list[torch.Tensor]:
        from ..rollout.logprobs import teacher_forced_logprobs

        out = []
        for i, seq in enumerate(sequences):
            s = len(seq)
            self.tracer.set_tokens(torch.full((s, 1), i), torch.arange(s).view(s, 1))
            with torch.enable_grad():
                out.append(teacher_forced_logprobs(self.gpt, [list(seq)])[0].detach().float().cpu())
        self.tracer.clear_tokens()
        return out


# ---- vLLM ---------------------------------------------------------------------------------------
class VllmOpHooks:
    """Hooks on vLLM's ``Qwen3MoeForCausalLM`` (inside the engine: ``llm.apply_model``) recording
    the ops of the module docstring for the sequence ``self.seq``. ``stock_ops``: see the module
    docstring; ``vllm_config``: the engine's config (needed to build vLLM's own rotary embedding)."""

    def __init__(self, tracer: Tracer, model: torch.nn.Module, stock_ops=(), vllm_config=None):
        bad = sorted(set(stock_ops) - set(STOCK_OPS))
        if bad:
            raise ValueError(f"--vllm-stock-ops {','.join(bad)}: choose from {', '.join(STOCK_OPS)}")
        self.tracer, self.model, self.stock_ops, self.vllm_config = tracer, model, tuple(stock_ops), vllm_config
        self.seq = 0
        self._layer = 0
        self._handles: list = []
        self._live = False
        self._final: tuple[torch.Tensor, torch.Tensor] | None = None  # this forward's final_norm rows and keys
        self._logit_keys: torch.Tensor | None = None

    # recording ---------------------------------------------------------------------------------
    def _rec(self, name, t, keys=None):
        if self._live:
            self.tracer.record(name, _flat(t.detach(), 1), keys=keys)

    def _hook(self, name, pick=_first):
        return lambda mod, args, out: self._rec(name, pick(out))

    def _norm_hook(self, prev_residual: str | None, name: str):
        """A norm that may carry the residual add: ``(norm, residual + x)`` when given a residual."""
        def hook(mod, args, out):
            if isinstance(out, (tuple, list)):
                if prev_residual is not None:
                    self._rec(prev_residual, out[1])
                self._rec(name, out[0])
            else:
                self._rec(name, out)
        return hook

    def _pre_forward(self, mod, args, kwargs):
        from vllm.forward_context import get_forward_context, is_forward_context_available

        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        meta = get_forward_context().attn_metadata if is_forward_context_available() else None
        self._live = bool(meta)  # vLLM's profiling / warm-up forwards have no requests
        if not self._live:
            return
        m = next(iter(meta.values())) if isinstance(meta, dict) else meta
        n = int(getattr(m, "num_actual_tokens", positions.shape[0]))
        pos = positions[:n].cpu()
        self._n = n
        self.tracer.set_tokens(torch.full_like(pos, self.seq), pos)

    def _rope_hook(self, mod, args, out):
        self._rec(f"layers.{self._layer}.rope_q", out[0])
        self._rec(f"layers.{self._layer}.rope_k", out[1])

    def _final_hook(self, mod, args, out):
        norm, h = out if isinstance(out, (tuple, list)) else (out, None)
        if h is not None:
            self._rec(f"layers.{len(self.model.model.layers) - 1}.mlp_residual", h)
        self._rec("final_norm", norm)
        if self._live:
            n = self._n
            self._final = (norm[:n].detach().cpu().clone(), self.tracer.grid_keys.clone())

    def _logits_pre(self, mod, args):
        """Key the rows of the LM head's input by the forward's final_norm rows they equal."""
        self._logit_keys = None
        if not self._live or self._final is None:
            return
        hidden = args[1].detach().cpu()
        rows, keys = self._final
        rb, hb = rows.contiguous().view(torch.int16), hidden.contiguous().view(torch.int16)
        match = (hb[:, None, :] == rb[None, :, :]).all(-1)  # [N, T]
        found = match.any(1)
        # the last matching position (a repeated row, e.g. the same token twice, is rare and keyed to its latest)
        idx = torch.where(found, match.int().cumsum(1).argmax(1), torch.zeros_like(found, dtype=torch.long))
        self._logit_keys = (keys[idx], found)

    def _logits_hook(self, name):
        def hook(mod, args, out):
            if self._logit_keys is not None:
                keys, found = self._logit_keys
                self._rec(name, out[found.to(out.device)], keys=keys[found])
        return hook

    # installing --------------------------------------------------------------------------------
    def _stock(self) -> None:
        """vLLM's own norm / rotary kernels in place of the plugin's (``stock_ops``)."""
        from vllm.model_executor.layers.layernorm import RMSNorm

        mm = self.model.model
        if "norm" in self.stock_ops:
            for m in mm.modules():
                if isinstance(m, RMSNorm) and type(m) is not RMSNorm:
                    m.forward = m._forward_method  # the dispatch vLLM's CustomOp chose for this device
        if "rope" in self.stock_ops:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.layers.rotary_embedding import get_rope

            cfg = self.vllm_config.model_config.hf_text_config
            with set_current_vllm_config(self.vllm_config):
                for layer in mm.layers:
                    att = layer.self_attn
                    att.rotary_emb = get_rope(att.head_dim, max_position=cfg.max_position_embeddings,
                                              rope_parameters=cfg.rope_parameters,
                                              dtype=self.vllm_config.model_config.dtype)

    def __enter__(self) -> "VllmOpHooks":
        self._stock()
        mm, add = self.model.model, self._handles.append
        roped: set[int] = set()
        # on the outer model: vLLM's @support_torch_compile gives the inner one a __call__ that skips hooks
        add(self.model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        add(mm.embed_tokens.register_forward_hook(self._hook("embedding")))
        for i, layer in enumerate(mm.layers):
            p = f"layers.{i}."
            att = layer.self_attn
            add(layer.input_layernorm.register_forward_hook(
                self._norm_hook(f"layers.{i - 1}.mlp_residual" if i else None, p + "input_norm")))
            add(att.qkv_proj.register_forward_hook(self._hook(p + "qkv")))
            add(att.q_norm.register_forward_hook(self._hook(p + "q_norm")))
            add(att.k_norm.register_forward_hook(self._hook(p + "k_norm")))

            add(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "_layer", i)))
            if id(att.rotary_emb) not in roped:  # one module may serve every layer (the plugin's RoPE does)
                roped.add(id(att.rotary_emb))
                add(att.rotary_emb.register_forward_hook(self._rope_hook))
            add(att.attn.register_forward_hook(self._hook(p + "attention")))
            add(att.o_proj.register_forward_hook(self._hook(p + "o_proj")))

            def post(m, args, out, p=p):
                self._rec(p + "attn_residual", out[1])
                self._rec(p + "post_attn_norm", out[0])

            add(layer.post_attention_layernorm.register_forward_hook(post))
            gate = getattr(layer.mlp, "gate", None)
            moe = hasattr(layer.mlp, "experts")
            if moe and gate is not None:
                add(gate.register_forward_hook(self._hook(p + "router_logits")))
            add(layer.mlp.register_forward_hook(self._hook(p + ("moe" if moe else "mlp"))))
        add(mm.norm.register_forward_hook(self._final_hook))
        add(self.model.logits_processor.register_forward_pre_hook(self._logits_pre))
        add(self.model.logits_processor.register_forward_hook(self._logits_hook("lm_head")))
        compute_logits = self.model.compute_logits

        def logged_compute_logits(hidden_states):
            out = compute_logits(hidden_states)
            if out is not None:
                self._logits_hook("logprobs")(None, None, out)
            return out

        self.model.compute_logits = logged_compute_logits
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.model.__dict__.pop("compute_logits", None)


__all__ = ["LearnerOpHooks", "OPS", "OP_DESCRIPTIONS", "STOCK_OPS", "VllmOpHooks", "op_of"]
