"""Named capture points for the divergence tracer: engine-agnostic, nearly free when off.

Engines call :func:`capture` at interesting points; nothing happens unless a :class:`Tracer`
is active (one list-truthiness test per call)::

    from minite_megatron.diagnostics import capture, Tracer

    capture(f"{prefix}.input_codes", q.codes)          # in a module's forward: no-op when off

    with Tracer(engine="learner") as tr:                # records while the block runs
        tr.attach(model)                                # forward hooks on Megatron submodules
        tr.set_tokens(seq_ids.view(1, b), position_ids.t())   # [s, b] grid of the next forward
        model(tokens, position_ids, attention_mask)
    tr.trace().save("learner.pt")

Rows are keyed by (sequence id, position), so engines that batch tokens differently (the
learner runs whole sequences ``[s, b, h]``; a rollout engine a prefill and then one token per
step, in batches of changing composition ``[tokens, h]``) produce comparable traces. Before each
forward the engine calls :meth:`Tracer.set_tokens` with the sequence id and position of every
token of that forward, as two tensors of the token grid's shape (``[s, b]``, ``[tokens]``, or
broadcastable to it). A per-token capture then takes a tensor whose leading dimensions equal the
grid (``[s, b, ...]``), or whose first dimension is the number of tokens in grid order
(``[s*b, ...]``, e.g. Megatron's router outputs), or an explicit ``keys=`` tensor.

Routed (expert-permuted) tensors are keyed by (token, expert): :func:`capture_routed` takes,
per row, the token's index in the current grid and the expert id. :meth:`Tracer.attach` does
this itself for Megatron's experts: it records each MoE layer's routing map from the router's
forward and reproduces Megatron's permutation (rows grouped by expert, tokens ascending inside
a group; ``megatron.core.transformer.moe.moe_utils.permute``). Routed rows are therefore compared
per (token, expert) pair, not after unpermuting; a token whose expert set differs between the
engines is reported as a routing mismatch of that point.

Limits: single process (no TP/SP/EP shards: a sharded activation is one rank's slice, and
attach raises for expert parallelism), forward passes only (activation recomputation would
capture rows twice: the first is kept and the rest counted as duplicates), and a capture inside
a ``torch.compile`` region forces a graph break.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

import torch

from ..ops.trace_hook import ACTIVE as _ACTIVE, active_tracer
from .trace import MAX_EXPERT, Trace, TracePoint, pack_keys

MEGATRON_PATTERNS: tuple[str, ...] = (
    "embedding",
    "*.input_layernorm",
    "*.self_attention.linear_qkv",
    "*.self_attention.q_layernorm",
    "*.self_attention.k_layernorm",
    "*.self_attention.core_attention",
    "*.self_attention.linear_proj",
    "*.pre_mlp_layernorm",
    "*.mlp.router",
    "*.mlp.linear_fc1",
    "*.mlp.linear_fc2",
    "*.mlp.experts.linear_fc1",
    "*.mlp.experts.linear_fc2",
    "*.mlp.experts.local_experts.*.linear_fc1",
    "*.mlp.experts.local_experts.*.linear_fc2",
    "*.mlp",
    "decoder.final_layernorm",
    "output_layer",
)
"""Default :meth:`Tracer.attach` patterns (fnmatch on Megatron module names, ``module.`` wrappers
stripped): norms, qkv, attention core and projection, router, dense and expert fc1/fc2, the MoE
layer output, the final norm and the logits."""

_ROUTER_RE = re.compile(r"^(?P<mlp>.*\.mlp)\.router$")
_LOCAL_EXPERT_RE = re.compile(r"^(?P<mlp>.*\.mlp)\.experts\.local_experts\.(?P<e>\d+)(\..+)?$")
_GROUPED_EXPERTS_RE = re.compile(r"^(?P<mlp>.*\.mlp)\.experts(\.linear_fc[12])?$")


def capture(name: str, tensor: torch.Tensor, *, keys: torch.Tensor | None = None) -> None:
    """Record a per-token tensor under ``name`` if a tracer is active (else do nothing).

    ``tensor``: leading dims equal to the token grid (``[s, b, ...]``), or ``[tokens, ...]`` in
    grid order, or any ``[rows, ...]`` with an explicit ``keys`` (int64 ``[rows]`` from
    :func:`~minite_megatron.diagnostics.trace.pack_keys`).
    """
    if _ACTIVE:
        _ACTIVE[-1].record(name, tensor, keys=keys)


def capture_routed(name: str, tensor: torch.Tensor, token_index: torch.Tensor, expert_index: torch.Tensor) -> None:
    """Record an expert-permuted tensor ``[rows, ...]``: row i belongs to grid token
    ``token_index[i]`` (index into the flattened grid) and expert ``expert_index[i]``."""
    if _ACTIVE:
        _ACTIVE[-1].record_routed(name, tensor, token_index, expert_index)


def capture_static(name: str, tensor: torch.Tensor) -> None:
    """Record a tensor that is not per token (a weight's codes, a global scale): one row per call."""
    if _ACTIVE:
        _ACTIVE[-1].record_static(name, tensor)


def _strip_wrappers(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def _first_tensor(obj) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        for o in obj:
            if isinstance(o, torch.Tensor):
                return o
    return None


def index_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` for any dtype (float8 and other 1-byte floats go through their bits)."""
    if values.dtype.is_floating_point and values.element_size() == 1:
        return values.view(torch.uint8)[index].view(values.dtype)
    return values[index]


def _cat(chunks: list[torch.Tensor]) -> torch.Tensor:
    if chunks[0].dtype.is_floating_point and chunks[0].element_size() == 1:
        return torch.cat([c.view(torch.uint8) for c in chunks]).view(chunks[0].dtype)
    return torch.cat(chunks)


class Tracer:
    """Records named capture points while active (``with Tracer(...) as t:``).

    Args:
        include: fnmatch patterns of names to record (None: all).
        exclude: fnmatch patterns of names to skip.
        engine: a label for the trace (``"learner"``, ``"rollout"``).
        to_cpu: copy captured tensors to the CPU (default) instead of keeping device copies.
        meta: free-form JSON-able metadata stored with the trace.
    """

    def __init__(
        self,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        *,
        engine: str = "",
        to_cpu: bool = True,
        meta: dict | None = None,
    ) -> None:
        self.include = tuple(include) if include is not None else None
        self.exclude = tuple(exclude or ())
        self.engine = engine
        self.to_cpu = to_cpu
        self.meta = dict(meta or {})
        self._grid_shape: tuple[int, ...] | None = None
        self._grid_keys: torch.Tensor | None = None  # packed, flattened [T], on the CPU
        self._chunks: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._kinds: dict[str, str] = {}
        self._order: list[str] = []
        self._static_calls: dict[str, int] = {}
        self._wants: dict[str, bool] = {}
        self._handles: list = []
        self._routing: dict[str, torch.Tensor] = {}  # "<...>.mlp" -> bool routing map [T, E]
        self._routed_ctx: list[tuple[torch.Tensor, torch.Tensor]] = []  # (token, expert) rows of running experts
        self._named: list[torch.nn.Module] = []

    # ---- activation ------------------------------------------------------------------------
    def __enter__(self) -> "Tracer":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self.detach()

    @property
    def active(self) -> bool:
        return self in _ACTIVE

    def wants(self, name: str) -> bool:
        """Whether ``name`` passes the include/exclude patterns (cached)."""
        w = self._wants.get(name)
        if w is None:
            w = (self.include is None or any(fnmatch.fnmatchcase(name, p) for p in self.include)) and not any(
                fnmatch.fnmatchcase(name, p) for p in self.exclude
            )
            self._wants[name] = w
        return w

    # ---- token grid ------------------------------------------------------------------------
    def set_tokens(self, seq_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Declare the tokens of the next forward(s): sequence id and position of each.

        ``seq_ids`` and ``positions`` are integer tensors broadcastable to the token grid shape,
        e.g. ``seq_ids.view(1, b)`` and ``position_ids.t()`` (``[s, b]``) for Megatron, or two
        ``[tokens]`` tensors for a flattened engine. Raises ValueError for non-integer ids, ids
        out of range, or a (sequence, position) pair that occurs twice in the grid.
        """
        seq_ids, positions = torch.as_tensor(seq_ids), torch.as_tensor(positions)
        for nm, t in (("seq_ids", seq_ids), ("positions", positions)):
            if t.is_floating_point() or t.dtype == torch.bool:
                raise ValueError(f"set_tokens: {nm} must be integers, got {t.dtype}")
        seq_ids, positions = torch.broadcast_tensors(seq_ids.cpu(), positions.cpu())
        keys = pack_keys(seq_ids.reshape(-1), positions.reshape(-1))
        if keys.numel() != keys.unique().numel():
            raise ValueError("set_tokens: a (sequence, position) pair occurs twice in the token grid")
        self._grid_shape = tuple(seq_ids.shape)
        self._grid_keys = keys

    def clear_tokens(self) -> None:
        self._grid_shape = None
        self._grid_keys = None
        self._routing.clear()

    @property
    def grid_keys(self) -> torch.Tensor | None:
        """The packed (sequence, position) keys of the current token grid, flattened (None: no grid)."""
        return self._grid_keys

    @property
    def num_tokens(self) -> int:
        return 0 if self._grid_keys is None else int(self._grid_keys.numel())

    # ---- recording -------------------------------------------------------------------------
    def _store(self, name: str, kind: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        prev = self._kinds.get(name)
        if prev is None:
            self._kinds[name] = kind
            self._order.append(name)
            self._chunks[name] = []
        elif prev != kind:
            raise ValueError(f"capture point {name!r} recorded as {prev!r} and now as {kind!r}")
        values = values.detach()
        values = values.to("cpu", copy=True) if self.to_cpu else values.clone()
        chunks = self._chunks[name]
        if chunks and chunks[0][1].shape[1:] != values.shape[1:]:
            raise ValueError(
                f"capture point {name!r}: row shape {tuple(values.shape[1:])} differs from the earlier "
                f"{tuple(chunks[0][1].shape[1:])}"
            )
        if chunks and chunks[0][1].dtype != values.dtype:
            raise ValueError(f"capture point {name!r}: dtype {values.dtype} differs from the earlier {chunks[0][1].dtype}")
        chunks.append((keys.to("cpu").long(), values))

    def _need_grid(self, name: str) -> torch.Tensor:
        if self._grid_keys is None:
            raise ValueError(
                f"capture {name!r}: no token grid; call tracer.set_tokens(seq_ids, positions) before the forward"
            )
        return self._grid_keys

    def record(self, name: str, tensor: torch.Tensor, *, keys: torch.Tensor | None = None) -> None:
        """Record a per-token tensor (see :func:`capture`)."""
        if not self.wants(name):
            return
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"capture {name!r}: expected a tensor, got {type(tensor).__name__}")
        if keys is not None:
            keys = torch.as_tensor(keys).reshape(-1)
            if tensor.dim() == 0 or tensor.shape[0] != keys.numel():
                raise ValueError(f"capture {name!r}: {keys.numel()} keys for a tensor of shape {tuple(tensor.shape)}")
            self._store(name, "token", keys, tensor)
            return
        if self._routed_ctx and tensor.dim() >= 1 and tensor.shape[0] == self._routed_ctx[-1][0].numel():
            # called from inside an expert module (see attach): rows are (token, expert) pairs
            tok, exp = self._routed_ctx[-1]
            self.record_routed(name, tensor, tok, exp)
            return
        self._record_token(name, tensor)

    def _record_token(self, name: str, tensor: torch.Tensor) -> None:
        gk = self._need_grid(name)
        g = self._grid_shape
        n = gk.numel()
        if tensor.dim() >= len(g) and tuple(tensor.shape[: len(g)]) == g:
            values = tensor.reshape(n, *tensor.shape[len(g) :])
        elif tensor.dim() >= 1 and tensor.shape[0] == n:
            values = tensor
        else:
            raise ValueError(
                f"capture {name!r}: tensor of shape {tuple(tensor.shape)} does not match the token grid "
                f"{g} ({n} tokens); pass keys= or capture it with capture_static"
            )
        self._store(name, "token", gk, values)

    def record_routed(self, name: str, tensor: torch.Tensor, token_index: torch.Tensor, expert_index: torch.Tensor) -> None:
        """Record an expert-permuted tensor (see :func:`capture_routed`)."""
        if not self.wants(name):
            return
        gk = self._need_grid(name)
        token_index = torch.as_tensor(token_index).reshape(-1).cpu().long()
        expert_index = torch.as_tensor(expert_index).reshape(-1).cpu().long()
        if token_index.numel() != expert_index.numel() or tensor.dim() == 0 or tensor.shape[0] != token_index.numel():
            raise ValueError(
                f"capture_routed {name!r}: {tensor.shape[0] if tensor.dim() else 0} rows, "
                f"{token_index.numel()} token indices, {expert_index.numel()} expert indices"
            )
        if token_index.numel() and (int(token_index.min()) < 0 or int(token_index.max()) >= gk.numel()):
            raise ValueError(f"capture_routed {name!r}: token index outside the grid of {gk.numel()} tokens")
        if expert_index.numel() and (int(expert_index.min()) < 0 or int(expert_index.max()) > MAX_EXPERT):
            raise ValueError(f"capture_routed {name!r}: expert ids must lie in [0, {MAX_EXPERT}]")
        keys = gk[token_index] | (expert_index + 1)  # grid keys carry expert field 0 (= not routed)
        self._store(name, "routed", keys, tensor)

    def record_static(self, name: str, tensor: torch.Tensor) -> None:
        """Record a tensor that is not per token: one row per call, keyed by the call index."""
        if not self.wants(name):
            return
        i = self._static_calls.get(name, 0)
        self._static_calls[name] = i + 1
        self._store(name, "static", torch.tensor([i]), tensor.reshape(1, *tensor.shape))

    # ---- Megatron hooks --------------------------------------------------------------------
    def attach(
        self, model: torch.nn.Module, patterns: Iterable[str] = MEGATRON_PATTERNS, *, inputs: bool = False
    ) -> int:
        """Register forward hooks on the submodules whose (wrapper-stripped) names match ``patterns``.

        Each matched module records ``{name}.output`` (its first tensor output) and, with
        ``inputs=True``, ``{name}.input``. A Megatron router records ``{name}.probs`` and
        ``{name}.routing_map``; modules under ``*.mlp.experts`` record routed rows keyed by
        (token, expert), using the routing map of their layer's router (which is always hooked,
        matched or not). While an expert module runs, :func:`capture` calls from inside it (e.g.
        a grouped NVFP4 linear's quantizer codes) whose first dimension is the module's routed
        row count are keyed the same way. A matched module with a ``trace_name`` attribute that is
        None (miniTE's NVFP4 linears) gets its name, so its own capture points
        (``{name}.input_codes``, ...) are named like the hooks. Hooks and names stay until
        :meth:`detach` or the end of the ``with`` block. Returns the number of modules matched.

        Raises ValueError if no module matches, or for expert parallelism (experts not all local).
        """
        patterns = tuple(patterns)
        named = [(_strip_wrappers(n), m) for n, m in model.named_modules() if n]
        by_name = dict(named)
        count = 0
        for name, mod in named:
            matched = any(fnmatch.fnmatchcase(name, p) for p in patterns)
            if _ROUTER_RE.match(name) is not None:
                self._handles.append(mod.register_forward_hook(self._router_hook(name, record=matched)))
                count += matched
                continue
            routed = _LOCAL_EXPERT_RE.match(name) is not None or _GROUPED_EXPERTS_RE.match(name) is not None
            if routed:  # routed-row context for captures made inside the module
                self._handles.append(mod.register_forward_pre_hook(self._routed_enter(name, by_name)))
            if matched:
                self._handles.append(mod.register_forward_hook(self._module_hook(name, inputs)))
                if getattr(mod, "trace_name", "missing") is None:
                    mod.trace_name = name
                    self._named.append(mod)
                count += 1
            if routed:  # after the recording hook (hooks run in registration order)
                self._handles.append(mod.register_forward_hook(self._routed_exit, always_call=True))
        if count == 0:
            raise ValueError(f"Tracer.attach: no submodule matches {patterns}")
        return count

    def detach(self) -> None:
        """Remove every hook registered by :meth:`attach` and reset the ``trace_name`` it set."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for mod in self._named:
            mod.trace_name = None
        self._named.clear()
        self._routed_ctx.clear()

    def _routed_enter(self, name: str, by_name: dict):
        def pre_hook(module, args):
            if self.active:
                self._routed_ctx.append(self._expert_rows(name, by_name))

        return pre_hook

    def _routed_exit(self, module, args, output) -> None:
        if self.active and self._routed_ctx:
            self._routed_ctx.pop()

    def _router_hook(self, name: str, record: bool):
        mlp = _ROUTER_RE.match(name)["mlp"]

        def hook(module, args, output):
            if not self.active:
                return
            if not (isinstance(output, tuple) and len(output) == 2):
                raise ValueError(f"Tracer: router {name!r} returned {type(output).__name__}, expected (probs, routing_map)")
            probs, routing_map = output
            self._routing[mlp] = routing_map.detach().bool().cpu()
            if record:
                self.record(f"{name}.probs", probs)
                self.record(f"{name}.routing_map", routing_map)

        return hook

    def _expert_rows(self, name: str, by_name: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token_index, expert_index) of the rows an expert module sees, or None if not routed."""
        m1 = _LOCAL_EXPERT_RE.match(name)
        m2 = None if m1 else _GROUPED_EXPERTS_RE.match(name)
        if m1 is None and m2 is None:
            return None
        mlp = (m1 or m2)["mlp"]
        rm = self._routing.get(mlp)
        if rm is None:
            raise ValueError(f"Tracer: expert module {name!r} ran before its router {mlp}.router was seen")
        moe = by_name.get(mlp)
        local = list(getattr(moe, "local_expert_indices", range(rm.shape[1])))
        if len(local) != rm.shape[1]:
            raise ValueError(
                f"Tracer.attach: {mlp} holds experts {local[:4]}... of {rm.shape[1]}; expert parallelism is "
                "not supported (capture routed rows with capture_routed instead)"
            )
        pairs = rm.t().nonzero()  # [(expert, token)] expert-major, tokens ascending: Megatron's permute
        if m1 is not None:
            e = int(m1["e"])
            pairs = pairs[pairs[:, 0] == e]
        return pairs[:, 1], pairs[:, 0]

    def _module_hook(self, name: str, inputs: bool):
        def hook(module, args, output):
            if not self.active:
                return
            # a routed module's context is still pushed here (its exit hook is registered after this one)
            rows = self._routed_ctx[-1] if (_LOCAL_EXPERT_RE.match(name) or _GROUPED_EXPERTS_RE.match(name)) else None
            todo = [(f"{name}.output", _first_tensor(output))]
            if inputs:
                todo.insert(0, (f"{name}.input", _first_tensor(args)))
            for point, t in todo:
                if t is None or not self.wants(point):
                    continue
                if rows is None:
                    self._record_token(point, t)
                else:
                    tok, exp = rows
                    if t.shape[0] != tok.numel():
                        raise ValueError(
                            f"Tracer: {point} has {t.shape[0]} rows but the routing map sends {tok.numel()} "
                            "(token, expert) pairs there (token dropping or padding is not supported)"
                        )
                    self.record_routed(point, t, tok, exp)

        return hook

    # ---- result ----------------------------------------------------------------------------
    def trace(self) -> Trace:
        """The recorded trace: per point, rows sorted by key with duplicates dropped (first kept)."""
        points = {}
        for name in self._order:
            chunks = self._chunks[name]
            keys = torch.cat([c[0] for c in chunks]) if len(chunks) > 1 else chunks[0][0]
            values = _cat([c[1] for c in chunks]) if len(chunks) > 1 else chunks[0][1]
            if keys.numel() < 2 or bool((keys[1:] > keys[:-1]).all()):  # already sorted and unique
                points[name] = TracePoint(name, self._kinds[name], keys, values, 0)
                continue
            sk, perm = torch.sort(keys, stable=True)
            first = torch.ones_like(sk, dtype=torch.bool)
            first[1:] = sk[1:] != sk[:-1]
            points[name] = TracePoint(
                name, self._kinds[name], sk[first], index_rows(values, perm[first]), int((~first).sum())
            )
        return Trace(points, list(self._order), self.engine, dict(self.meta))


__all__ = [
    "MEGATRON_PATTERNS",
    "Tracer",
    "active_tracer",
    "capture",
    "capture_routed",
    "capture_static",
    "index_rows",
]
