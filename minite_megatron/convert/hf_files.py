"""Hugging Face safetensors checkpoints on disk: a lazy reader of slices and a sharded writer.

Reader (:class:`HFCheckpoint`): ``config.json`` plus either one ``model.safetensors`` or the
shards named by ``model.safetensors.index.json``. Opening it reads only the JSON files and the
safetensors *headers* (names, dtypes, shapes); :meth:`HFCheckpoint.read` then reads exactly the
rows and columns asked for through ``safe_open(...).get_slice(...)``, so a rank of a parallel
model reads only its shard's bytes. Errors (one line each, :class:`~.errors.ConvertError`): a
missing config or index, an index naming a missing shard or a tensor the shard lacks, a shard
that is not safetensors, a non-floating-point tensor.

Writer (:class:`HFShardWriter`): tensors are added one by one, shards of at most
``max_shard_bytes`` are written as they fill (so memory holds one shard), and :meth:`finish`
names them ``model-0000i-of-0000N.safetensors`` and writes the index and ``config.json`` the way
``transformers``' ``save_pretrained`` does (one shard: ``model.safetensors``, no index).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .errors import ConvertError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class HFCheckpoint:
    """A Hugging Face checkpoint directory, opened lazily (module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.root = Path(path)
        if not self.root.is_dir():
            raise ConvertError(f"convert: {self.root} is not a directory")
        from .hf_config import read_hf_config

        self.config = read_hf_config(self.root)
        self.indexed = (self.root / INDEX_FILE).is_file()
        self.weight_map = self._weight_map()
        self._handles: dict[str, object] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        self._read_headers()

    def _weight_map(self) -> dict[str, str]:
        index = self.root / INDEX_FILE
        if index.is_file():
            try:
                data = json.loads(index.read_text())
                weight_map = dict(data["weight_map"])
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConvertError(f"convert: {index} is not a safetensors index ({type(e).__name__}: {e})") from None
            for fname in sorted(set(weight_map.values())):
                if not (self.root / fname).is_file():
                    raise ConvertError(f"convert: {INDEX_FILE} names shard {fname}, which is missing in {self.root}")
            return weight_map
        single = self.root / SINGLE_FILE
        if single.is_file():
            return {name: SINGLE_FILE for name in self._header(SINGLE_FILE)}
        raise ConvertError(f"convert: {self.root} has neither {INDEX_FILE} nor {SINGLE_FILE}")

    def _header(self, fname: str) -> dict:
        """The safetensors header of ``fname`` (names -> dtype, shape), read without the data."""
        path = self.root / fname
        try:
            with open(path, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if not 0 < n <= 100 * 2**20:
                    raise ValueError(f"header length {n}")
                header = json.loads(fh.read(n))
        except (OSError, ValueError) as e:
            raise ConvertError(f"convert: {path} is not a safetensors file ({e})") from None
        header.pop("__metadata__", None)
        return header

    def _read_headers(self) -> None:
        by_file: dict[str, list[str]] = {}
        for name, fname in self.weight_map.items():
            by_file.setdefault(fname, []).append(name)
        for fname, names in sorted(by_file.items()):
            header = self._header(fname)
            for name in names:
                if name not in header:
                    raise ConvertError(f"convert: {INDEX_FILE} places {name} in {fname}, which does not hold it")
                dtype = header[name]["dtype"]
                if dtype not in _DTYPES:
                    raise ConvertError(f"convert: tensor {name} in {fname} has dtype {dtype}; expected a floating-point "
                                       "weight (quantized checkpoints are not supported)")
                self.shapes[name] = tuple(int(s) for s in header[name]["shape"])
                self.dtypes[name] = dtype

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _slice(self, name: str):
        from safetensors import safe_open

        fname = self.weight_map[name]
        handle = self._handles.get(fname)
        if handle is None:
            handle = self._handles[fname] = safe_open(str(self.root / fname), framework="pt", device="cpu")
        return handle.get_slice(name)

    def read(self, name: str, index: int | None, rows: tuple[int, int], cols: tuple[int, int] | None) -> torch.Tensor:
        """``tensor[index][rows[0]:rows[1], cols[0]:cols[1]]`` read from disk (only those bytes);
        ``index`` None for a 1-D / 2-D tensor, ``cols`` None for a 1-D one."""
        sl = self._slice(name)
        r = slice(*rows)
        if index is None:
            return sl[r] if cols is None else sl[r, slice(*cols)]
        return (sl[index : index + 1, r] if cols is None else sl[index : index + 1, r, slice(*cols)])[0]

    def close(self) -> None:
        self._handles.clear()


def parse_size(size: int | str) -> int:
    """``5000000``, ``"5GB"``, ``"500MB"``, ``"64KB"`` -> bytes (decimal units, like transformers)."""
    if isinstance(size, int):
        return size
    s = str(size).strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3),
                       ("B", 1)):
        if s.endswith(unit):
            try:
                return int(float(s[: -len(unit)]) * mult)
            except ValueError:
                break
    try:
        return int(s)
    except ValueError:
        raise ConvertError(f"convert: shard size {size!r} is not a size (e.g. 5GB, 500MB)") from None


class HFShardWriter:
    """Write tensors into sharded safetensors files as they come (module docstring)."""

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int | str = "5GB"):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.max_bytes = parse_size(max_shard_bytes)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._files):
            raise ConvertError(f"convert: tensor {name} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._pending:
            return
        tmp = f"model-part-{len(self._files) + 1:05d}.safetensors.tmp"
        save_file(self._pending, str(self.out / tmp), metadata={"format": "pt"})
        self._files.append((tmp, sorted(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def finish(self, config: dict) -> list[str]:
        """Write the last shard, name the shards, write the index (if several) and ``config.json``.
        Returns the shard file names."""
        self._flush()
        n = len(self._files)
        names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (tmp, tensors), final in zip(self._files, names):
            os.replace(self.out / tmp, self.out / final)
            weight_map.update({t: final for t in tensors})
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        elif (self.out / INDEX_FILE).exists():
            (self.out / INDEX_FILE).unlink()
        (self.out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return names


__all__ = ["HFCheckpoint", "HFShardWriter", "INDEX_FILE", "SINGLE_FILE", "parse_size"]
