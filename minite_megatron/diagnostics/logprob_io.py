"""Per-token log-prob files for ``minite-diagnose gap``: one file per engine, same tokens.

Accepted formats (by suffix):

- ``.pt`` / ``.pth`` (``torch.save``): a float tensor ``[B, T]`` or ``[T]`` of log-probs, or a
  dict ``{"logprobs": tensor or list of 1-D tensors (ragged), "mask": bool [B, T] (optional),
  "topk": {layer: int [tokens, k]} (optional), "topk_mask": bool [tokens] (optional)}``.
- ``.safetensors``: tensors ``logprobs``, optional ``mask``, ``topk_mask`` and
  ``topk/layer_{i}``.
- ``.json``: ``{"logprobs": [[...], ...]}`` (ragged lists are padded and masked), optional
  ``"mask"``, ``"topk": {"<layer>": [[e0, e1, ...], ...]}``, ``"topk_mask"``.
- ``.jsonl``: one sequence per line, ``{"logprobs": [...]}`` (other fields ignored).

:func:`save_logprobs` writes the first two.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .metrics import pad_sequences


@dataclass
class LogprobFile:
    """Log-probs ``[B, T]`` (float), an optional bool mask and optional router top-k per layer."""

    logprobs: torch.Tensor
    mask: torch.Tensor | None = None
    topk: dict[int, torch.Tensor] | None = None
    topk_mask: torch.Tensor | None = None


def _as_batch(lp, mask) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(lp, torch.Tensor):
        if not lp.is_floating_point():
            raise ValueError(f"logprobs must be floating point, got {lp.dtype}")
        return (lp.unsqueeze(0) if lp.dim() == 1 else lp), (None if mask is None else torch.as_tensor(mask).reshape(-1, lp.shape[-1]).bool())
    if isinstance(lp, (list, tuple)):
        if lp and not isinstance(lp[0], (list, tuple, torch.Tensor)):
            lp = [lp]  # one flat sequence
        padded, m = pad_sequences(lp)
        if mask is not None:
            m2, _ = pad_sequences([[float(v) for v in row] for row in mask])
            m = m & (m2 != 0)
        return padded, m
    raise ValueError(f"logprobs must be a tensor or a list of sequences, got {type(lp).__name__}")


def _topk_dict(obj) -> dict[int, torch.Tensor] | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise ValueError("topk must map a layer number to an int [tokens, k] tensor")
    out = {}
    for k, v in obj.items():
        layer = int(str(k).removeprefix("layer_"))
        out[layer] = torch.as_tensor(v).long()
    return out


def load_logprobs(path: str | Path) -> LogprobFile:
    """Read a log-prob file (formats in the module docstring).

    Raises FileNotFoundError, or ValueError for an unknown suffix, missing ``logprobs`` or a
    corrupt/truncated file.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no log-prob file at {path}")
    try:
        return _read_logprobs(path)
    except (ValueError, FileNotFoundError) as e:
        if isinstance(e, json.JSONDecodeError):
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt or truncated file: bad input, one line
        reason = (str(e).strip().splitlines() or [""])[0].split(". ")[0]
        detail = "the file is empty" if path.stat().st_size == 0 else f"{type(e).__name__}: {reason}".rstrip(": ")
        raise ValueError(f"{path}: not a readable log-prob file ({detail})") from None


def _read_logprobs(path: Path) -> LogprobFile:
    suf = path.suffix
    if suf in (".pt", ".pth"):
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(obj, torch.Tensor):
            obj = {"logprobs": obj}
    elif suf == ".safetensors":
        from safetensors.torch import load_file

        flat = load_file(str(path))
        obj = {k: v for k, v in flat.items() if not k.startswith("topk/")}
        tk = {k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith("topk/")}
        if tk:
            obj["topk"] = tk
    elif suf == ".json":
        obj = json.loads(path.read_text())
    elif suf == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        obj = {"logprobs": [r["logprobs"] for r in rows]}
    else:
        raise ValueError(f"{path}: log-prob files end in .pt, .safetensors, .json or .jsonl")
    if not isinstance(obj, dict) or "logprobs" not in obj:
        raise ValueError(f"{path}: no 'logprobs' entry")
    lp, mask = _as_batch(obj["logprobs"], obj.get("mask"))
    tm = obj.get("topk_mask")
    return LogprobFile(lp, mask, _topk_dict(obj.get("topk")), None if tm is None else torch.as_tensor(tm).bool())


def save_logprobs(
    path: str | Path,
    logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    topk: dict[int, torch.Tensor] | None = None,
    topk_mask: torch.Tensor | None = None,
) -> Path:
    """Write a ``.pt`` or ``.safetensors`` log-prob file that :func:`load_logprobs` reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        flat = {"logprobs": logprobs.contiguous().cpu()}
        if mask is not None:
            flat["mask"] = mask.bool().contiguous().cpu()
        if topk_mask is not None:
            flat["topk_mask"] = topk_mask.bool().contiguous().cpu()
        for layer, t in (topk or {}).items():
            flat[f"topk/layer_{int(layer)}"] = t.long().contiguous().cpu()
        save_file(flat, str(path))
    elif path.suffix in (".pt", ".pth"):
        obj = {"logprobs": logprobs.cpu()}
        if mask is not None:
            obj["mask"] = mask.bool().cpu()
        if topk is not None:
            obj["topk"] = {int(k): v.long().cpu() for k, v in topk.items()}
        if topk_mask is not None:
            obj["topk_mask"] = topk_mask.bool().cpu()
        torch.save(obj, path)
    else:
        raise ValueError(f"save_logprobs writes .pt or .safetensors, got {path.name!r}")
    return path


__all__ = ["LogprobFile", "load_logprobs", "save_logprobs"]
