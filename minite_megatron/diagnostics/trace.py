"""A recorded trace: named capture points, each a set of rows keyed by (sequence, position, expert).

A :class:`Trace` is what a :class:`~minite_megatron.diagnostics.capture.Tracer` produces and
what :func:`~minite_megatron.diagnostics.compare.compare_traces` consumes. Each
:class:`TracePoint` holds

- ``keys``: int64 ``[rows]``, one packed key per row (:func:`pack_keys`), sorted ascending
  and unique;
- ``values``: ``[rows, ...]`` in the dtype the engine produced (bitwise comparisons need it);
- ``kind``: ``"token"`` (one row per token), ``"routed"`` (one row per (token, expert) pair:
  expert-permuted MoE tensors) or ``"static"`` (not per token, e.g. a weight: one row per call,
  keyed by the call's index);
- ``duplicates``: rows dropped because their key was already recorded (the first one is kept).

The order of the points in ``Trace.order`` is the order in which the engine first captured
them: the *execution order* that defines "first divergence".

Key packing: ``key = ((seq << 24) | pos) << 13 | (expert + 1)``; ``seq`` in ``[0, 2^26)``,
``pos`` in ``[0, 2^24)``, ``expert`` in ``[-1, 8190]`` (-1 = not routed). A static point's key is its call index
(0 for the first capture of that name, 1 for the second, ...).

Files (:meth:`Trace.save` / :func:`load_trace`), chosen by the suffix:

- ``.pt`` (``torch.save``): ``{"format": "minite-trace", "version": 1, "engine": str,
  "meta": dict, "order": [names], "points": {name: {"kind", "keys", "values", "duplicates"}}}``;
  loadable with ``torch.load(weights_only=True)``.
- ``.safetensors``: tensors ``"{name}::keys"`` and ``"{name}::values"``; the header's
  ``__metadata__["minite_trace"]`` holds the JSON of ``{"format", "version", "engine",
  "meta", "order", "kinds", "duplicates"}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = "minite-trace"
VERSION = 1
SEQ_BITS, POS_BITS, EXPERT_BITS = 26, 24, 13
MAX_SEQ, MAX_POS, MAX_EXPERT = 2**SEQ_BITS, 2**POS_BITS, 2**EXPERT_BITS - 2
KINDS = ("token", "routed", "static")


def pack_keys(seq: torch.Tensor, pos: torch.Tensor, expert: torch.Tensor | int = -1) -> torch.Tensor:
    """Pack (sequence id, position, expert) into int64 keys (same shape as ``seq``).

    Raises ValueError for ids outside ``[0, 2^26)``, positions outside ``[0, 2^24)`` or experts
    outside ``[-1, 8190]``.
    """
    seq = torch.as_tensor(seq).long()
    pos = torch.as_tensor(pos, device=seq.device).long()
    expert = torch.as_tensor(expert, device=seq.device).long().expand_as(seq)
    if seq.numel():
        if int(seq.min()) < 0 or int(seq.max()) >= MAX_SEQ:
            raise ValueError(f"sequence ids must lie in [0, {MAX_SEQ}), got [{int(seq.min())}, {int(seq.max())}]")
        if int(pos.min()) < 0 or int(pos.max()) >= MAX_POS:
            raise ValueError(f"positions must lie in [0, {MAX_POS}), got [{int(pos.min())}, {int(pos.max())}]")
        if int(expert.min()) < -1 or int(expert.max()) > MAX_EXPERT:
            raise ValueError(f"expert ids must lie in [-1, {MAX_EXPERT}], got [{int(expert.min())}, {int(expert.max())}]")
    return (((seq << POS_BITS) | pos) << EXPERT_BITS) | (expert + 1)


def unpack_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_keys`: (seq, pos, expert) int64 tensors."""
    keys = keys.long()
    expert = (keys & (2**EXPERT_BITS - 1)) - 1
    rest = keys >> EXPERT_BITS
    return rest >> POS_BITS, rest & (2**POS_BITS - 1), expert


def token_part(keys: torch.Tensor) -> torch.Tensor:
    """The (seq, pos) part of packed keys (the expert field zeroed): one value per token."""
    return (keys.long() >> EXPERT_BITS) << EXPERT_BITS


def describe_key(key: int, kind: str) -> str:
    """Human-readable key: ``seq 3 pos 17``, ``seq 3 pos 17 expert 5`` or ``call 2``."""
    if kind == "static":
        return f"call {int(key)}"
    s, p, e = (int(v) for v in unpack_keys(torch.tensor([int(key)])))
    return f"seq {s} pos {p}" + (f" expert {e}" if e >= 0 else "")


@dataclass
class TracePoint:
    """One capture point: sorted unique ``keys`` [rows] and ``values`` [rows, ...]."""

    name: str
    kind: str
    keys: torch.Tensor
    values: torch.Tensor
    duplicates: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"trace point {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.keys.dim() != 1 or self.keys.dtype != torch.int64:
            raise ValueError(f"trace point {self.name!r}: keys must be int64 [rows]")
        if self.values.shape[:1] != self.keys.shape:
            raise ValueError(
                f"trace point {self.name!r}: {self.keys.numel()} keys for values of shape {tuple(self.values.shape)}"
            )

    @property
    def rows(self) -> int:
        return int(self.keys.numel())


@dataclass
class Trace:
    """Named capture points in execution order, from one engine."""

    points: dict[str, TracePoint] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    engine: str = ""
    meta: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> TracePoint:
        return self.points[name]

    def __contains__(self, name: str) -> bool:
        return name in self.points

    def __len__(self) -> int:
        return len(self.order)

    def names(self) -> list[str]:
        return list(self.order)

    def restrict(self, token_keys: torch.Tensor) -> "Trace":
        """A trace holding only the rows of the given tokens (``pack_keys(seq, pos)``), e.g. to
        drop padding or positions an engine computed past a sequence's end. Routed rows follow
        their token; static points are kept whole."""
        valid = torch.as_tensor(token_keys).long().reshape(-1).unique()
        points = {}
        for name, pt in self.points.items():
            if pt.kind == "static":
                points[name] = pt
                continue
            keep = torch.isin(token_part(pt.keys), valid)
            points[name] = TracePoint(name, pt.kind, pt.keys[keep], pt.values[keep], pt.duplicates)
        return Trace(points=points, order=list(self.order), engine=self.engine, meta=dict(self.meta))

    # ---- files ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write to ``.pt`` (torch.save) or ``.safetensors`` (by suffix); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            tensors: dict[str, torch.Tensor] = {}
            for n in self.order:
                p = self.points[n]
                tensors[f"{n}::keys"] = p.keys.cpu().clone()  # points of one grid share a keys tensor
                tensors[f"{n}::values"] = p.values.contiguous().cpu()
            header = {
                "format": FORMAT,
                "version": VERSION,
                "engine": self.engine,
                "meta": self.meta,
                "order": self.order,
                "kinds": {n: self.points[n].kind for n in self.order},
                "duplicates": {n: self.points[n].duplicates for n in self.order},
            }
            save_file(tensors, str(path), metadata={"minite_trace": json.dumps(header)})
        elif path.suffix in (".pt", ".pth"):
            torch.save(
                {
                    "format": FORMAT,
                    "version": VERSION,
                    "engine": self.engine,
                    "meta": self.meta,
                    "order": list(self.order),
                    "points": {
                        n: {
                            "kind": self.points[n].kind,
                            "keys": self.points[n].keys.cpu(),
                            "values": self.points[n].values.cpu(),
                            "duplicates": self.points[n].duplicates,
                        }
                        for n in self.order
                    },
                },
                path,
            )
        else:
            raise ValueError(f"trace files end in .pt or .safetensors, got {path.name!r}")
        return path


def load_trace(path: str | Path) -> Trace:
    """Read a trace written by :meth:`Trace.save`.

    Raises FileNotFoundError, or ValueError for a file that is not a miniTE trace (wrong
    format tag, unsupported version, inconsistent contents, or a corrupt/truncated file).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no trace file at {path}")
    try:
        return _read_trace(path)
    except (ValueError, FileNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt or truncated file: bad input, one line
        reason = (str(e).strip().splitlines() or [""])[0].split(". ")[0]
        detail = "the file is empty" if path.stat().st_size == 0 else f"{type(e).__name__}: {reason}".rstrip(": ")
        raise ValueError(f"{path}: not a readable trace file ({detail})") from None


def _read_trace(path: Path) -> Trace:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
            if "minite_trace" not in md:
                raise ValueError(f"{path}: a safetensors file without a 'minite_trace' header is not a trace")
            header = json.loads(md["minite_trace"])
            _check_header(path, header)
            points = {}
            for n in header["order"]:
                points[n] = TracePoint(
                    n,
                    header["kinds"][n],
                    f.get_tensor(f"{n}::keys"),
                    f.get_tensor(f"{n}::values"),
                    int(header["duplicates"].get(n, 0)),
                )
        return Trace(points, list(header["order"]), header.get("engine", ""), header.get("meta", {}))
    if path.suffix in (".pt", ".pth"):
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: not a miniTE trace (got a {type(obj).__name__})")
        _check_header(path, obj)
        points = {
            n: TracePoint(n, p["kind"], p["keys"], p["values"], int(p.get("duplicates", 0)))
            for n, p in obj["points"].items()
        }
        missing = [n for n in obj["order"] if n not in points]
        if missing:
            raise ValueError(f"{path}: order names points that are absent: {missing[:5]}")
        return Trace(points, list(obj["order"]), obj.get("engine", ""), obj.get("meta", {}))
    raise ValueError(f"trace files end in .pt or .safetensors, got {path.name!r}")


def _check_header(path: Path, header: dict) -> None:
    if header.get("format") != FORMAT:
        raise ValueError(f"{path}: not a miniTE trace (format {header.get('format')!r})")
    if header.get("version") != VERSION:
        raise ValueError(f"{path}: trace version {header.get('version')} is not supported (expected {VERSION})")


__all__ = [
    "Trace",
    "TracePoint",
    "describe_key",
    "load_trace",
    "pack_keys",
    "token_part",
    "unpack_keys",
]
