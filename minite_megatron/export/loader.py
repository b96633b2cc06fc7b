"""Read a checkpoint written by :func:`~.modelopt.export_modelopt` back, bit for bit.

:func:`load_modelopt` returns a :class:`ModelOptCheckpoint` holding each quantized HF linear as an
:class:`~minite_megatron.nvfp4.NVFP4Tensor` (codes, linear block scales, the ``weight_scale_2``
global decode scale, the tile recorded at export), the static ``input_scale`` tensors if any, and
every other tensor as stored. From there:

- :meth:`ModelOptCheckpoint.dequantized_state_dict`: HF names -> dense tensors
  (``e2m1 * weight_scale * weight_scale_2``), what a BF16 engine would load;
- :meth:`ModelOptCheckpoint.to_megatron`: the Megatron names and layouts the learner exported
  (q/k/v re-interleaved into ``linear_qkv``, gate/up stacked into ``linear_fc1``, ``[E, N, K]``
  expert tensors re-stacked), bitwise equal to the learner's tensors.

Every check that fails raises ValueError naming the tensor: a wrong dtype or shape, a
``weight_scale_2`` whose bits differ from the recorded ones, 16x16-tile scales that vary inside
a tile, pieces of a fused weight with different global scales.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..nvfp4 import BLOCK, NVFP4Tensor
from .modelopt import FORMAT_VERSION, INDEX_FILE, QUANT_FILE, QUANT_METHOD, fp32_bits
from .names import megatron_target
from .rows import concat_rows, stack_groups, take_rows


@dataclass
class ModelOptCheckpoint:
    """A loaded export (see the module docstring)."""

    path: Path
    config: dict
    hf_quant_config: dict
    modules: dict[str, dict]
    tensor_sources: dict[str, str]
    quantized: dict[str, NVFP4Tensor] = field(default_factory=dict)
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def recipe(self) -> dict:
        return self.config["minite"]["recipe"]

    @property
    def variant(self) -> str:
        """``"minite"`` (the learner's policy), ``"modelopt-w4a4-static"`` or ``"modelopt-w4a16"``."""
        return self.config["minite"].get("variant", "minite")

    def dequantized_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """HF tensor names -> dense tensors: quantized linears dequantized (fp32, then ``dtype``),
        the rest as stored. Static ``input_scale`` tensors are left out."""
        out = {f"{m}.weight": q.dequantize(dtype) for m, q in self.quantized.items()}
        out.update(self.tensors)
        return out

    def to_megatron(self) -> dict[str, NVFP4Tensor | torch.Tensor]:
        """The learner's Megatron-named tensors, reassembled without re-quantization."""
        out: dict[str, NVFP4Tensor | torch.Tensor] = {}
        by_source: dict[str, dict[int | None, list[tuple[str, dict]]]] = {}
        for module, meta in self.modules.items():
            by_source.setdefault(meta["source"], {}).setdefault(meta.get("expert"), []).append((module, meta))
        for source, per_expert in by_source.items():
            target = megatron_target(source)
            if target.expert == -1:
                experts = [self._assemble(source, per_expert[e]) for e in sorted(per_expert)]
                if sorted(per_expert) != list(range(len(experts))):
                    raise ValueError(f"load: {source}: experts {sorted(per_expert)} are not 0..{len(experts) - 1}")
                if all(isinstance(x, NVFP4Tensor) for x in experts):
                    out[source] = stack_groups(experts, source)
                else:
                    out[source] = torch.stack(experts)
            else:
                (pieces,) = per_expert.values()
                out[source] = self._assemble(source, pieces)
        for hf_name, source in self.tensor_sources.items():
            out[source] = self.tensors[hf_name]
        return out

    def _module_weight(self, module: str) -> NVFP4Tensor | torch.Tensor:
        return self.quantized[module] if module in self.quantized else self.tensors[f"{module}.weight"]

    def _assemble(self, source: str, pieces: list[tuple[str, dict]]) -> NVFP4Tensor | torch.Tensor:
        """Put the rows of the HF modules back where they came from in the Megatron tensor."""
        segments = []  # (start, end, module, offset in the module's rows)
        for module, meta in pieces:
            off = 0
            for a, b in meta["rows"]:
                segments.append((a, b, module, off))
                off += b - a
        segments.sort()
        pos = 0
        for a, b, module, _ in segments:
            if a != pos:
                raise ValueError(f"load: {source}: rows [{pos}, {a}) are missing or overlap at {module}")
            pos = b
        weights = {m: self._module_weight(m) for m, _ in pieces}
        if all(isinstance(w, NVFP4Tensor) for w in weights.values()):
            if len(segments) == 1:
                return weights[segments[0][2]]
            parts = [take_rows(weights[m], [(off, off + b - a)], f"{source} <- {m}") for a, b, m, off in segments]
            return concat_rows(parts, source)
        if any(isinstance(w, NVFP4Tensor) for w in weights.values()):
            raise ValueError(f"load: {source} is made of quantized and unquantized pieces")
        return torch.cat([weights[m][off : off + b - a] for a, b, m, off in segments])


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise ValueError(f"load: {path.name} is missing in {path.parent}")
    return json.loads(path.read_text())


def load_modelopt(path: str | Path) -> ModelOptCheckpoint:
    """Load an export directory (see the module docstring). Raises ValueError on any mismatch."""
    from safetensors.torch import load_file

    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"load: {root} is not a directory")
    config = _read_json(root / "config.json")
    qc = config.get("quantization_config", {})
    declared = (qc.get("quant_method"), qc.get("quant_algo"))
    if declared not in ((QUANT_METHOD, "NVFP4_W4A4_PER_TOKEN"), ("modelopt", "NVFP4"), ("modelopt", "W4A16_NVFP4")):
        raise ValueError(f"load: {root} is not a miniTE NVFP4 or ModelOpt NVFP4 checkpoint (quantization_config {qc!r})")
    if config.get("minite", {}).get("format_version") != FORMAT_VERSION:
        raise ValueError(f"load: {root} has no miniTE section of format version {FORMAT_VERSION}")
    quant = _read_json(root / QUANT_FILE)
    index = _read_json(root / INDEX_FILE)
    flat: dict[str, torch.Tensor] = {}
    for fname in sorted(set(index["weight_map"].values())):
        part = load_file(str(root / fname))
        for k in part:
            if index["weight_map"].get(k) != fname:
                raise ValueError(f"load: {fname} holds {k!r}, which the index places elsewhere")
        flat.update(part)
    missing = sorted(set(index["weight_map"]) - set(flat))
    if missing:
        raise ValueError(f"load: tensors listed in the index are absent: {missing[:5]}")

    hf_quant = _read_json(root / "hf_quant_config.json") if (root / "hf_quant_config.json").exists() else {}
    ckpt = ModelOptCheckpoint(root, config, hf_quant, quant["modules"], quant.get("tensors", {}))
    for module, meta in quant["modules"].items():
        if not meta["quantized"]:
            if f"{module}.weight" not in flat:
                raise ValueError(f"load: {module}.weight is missing")
            continue
        ckpt.quantized[module] = _read_quantized(module, meta, flat)
        if f"{module}.input_scale" in flat:
            ckpt.input_scales[module] = flat.pop(f"{module}.input_scale")
    ckpt.tensors = flat
    return ckpt


def _read_quantized(module: str, meta: dict, flat: dict[str, torch.Tensor]) -> NVFP4Tensor:
    try:
        codes = flat.pop(f"{module}.weight")
        scales = flat.pop(f"{module}.weight_scale")
        s2 = flat.pop(f"{module}.weight_scale_2")
    except KeyError as e:
        raise ValueError(f"load: {module}: tensor {e.args[0]!r} is missing") from None
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"load: {module}.weight must be uint8 [N, K/2], got {codes.dtype} {tuple(codes.shape)}")
    n, k = codes.shape[0], codes.shape[1] * 2
    if scales.dtype != torch.float8_e4m3fn or tuple(scales.shape) != (n, k // BLOCK):
        raise ValueError(
            f"load: {module}.weight_scale must be float8_e4m3fn [{n}, {k // BLOCK}], got {scales.dtype} {tuple(scales.shape)}"
        )
    if s2.dtype != torch.float32 or s2.numel() != 1:
        raise ValueError(f"load: {module}.weight_scale_2 must be one float32, got {s2.dtype} {tuple(s2.shape)}")
    if "weight_scale_2_bits" in meta and fp32_bits(s2) != meta["weight_scale_2_bits"]:
        raise ValueError(f"load: {module}.weight_scale_2 bits {fp32_bits(s2)} differ from the recorded {meta['weight_scale_2_bits']}")
    tile = tuple(meta.get("tile", (1, BLOCK)))
    if tile == (BLOCK, BLOCK):
        if n % BLOCK:
            raise ValueError(f"load: {module} claims 16x16 tiles but has {n} rows")
        t = scales.view(torch.uint8).reshape(n // BLOCK, BLOCK, k // BLOCK)
        if not bool((t == t[:, :1]).all()):
            raise ValueError(f"load: {module} claims 16x16 tiles but its scales vary inside a tile")
    elif tile != (1, BLOCK):
        raise ValueError(f"load: {module}: unsupported tile {tile}")
    return NVFP4Tensor(
        codes=codes,
        block_scales=scales,
        global_decode=s2.reshape(1).to(torch.float32),
        shape=torch.Size([n, k]),
        global_scale="tensor",
        tile=tile,
    )


__all__ = ["ModelOptCheckpoint", "load_modelopt"]
