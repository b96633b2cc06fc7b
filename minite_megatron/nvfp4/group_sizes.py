"""The group sizes of a grouped (MoE) GEMM on the host, and the index tensors its kernels read.

Megatron's token dispatcher brings the number of tokens of every local expert to the host once
per MoE layer (its one host synchronization there). The grouped kernels read them on the device
as prefix offsets, and the wgrad operands (tokens along K, each expert's tokens zero-padded to a
multiple of 16: :mod:`.grouped`) through a column gather. :class:`GroupSizes` is the host sizes
-- a tuple of ints, usable wherever a ``Sequence[int]`` of sizes is -- with those device tensors
made once and reused by every GEMM on the same groups (fc1 and fc2 of an MoE layer, their
forward and backward)::

    offsets(device)         int32 [G + 1]   row offsets:  0, s_0, s_0 + s_1, ...
    padded()                GroupSizes      the sizes rounded up to multiples of 16
    padded_offsets(device)  int32 [G + 1]   offsets of the padded sizes
    column_index(device)    int32 [T_pad]   padded column c -> its source row, -1 for padding

Both offset vectors are summed on the host and reach a CUDA device in one copy from pinned
memory with ``non_blocking=True`` (no host synchronization; the caching host allocator keeps the
pinned block until the copy has run); the column index is computed on the device from them. One
group (a dense linear's token count) needs no copy at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .formats import BLOCK


class GroupSizes(tuple):
    """Non-negative group sizes (a tuple of ints) with their device index tensors (module docstring).

    Raises ValueError for a negative size. Sizes and offsets must stay below 2**31 (int32).
    """

    def __new__(cls, sizes: Sequence[int]):
        values = tuple(int(s) for s in sizes)
        for s in values:
            if s < 0:
                raise ValueError(f"negative group size {s} in {list(values)}")
        self = super().__new__(cls, values)
        self._base = None  # the GroupSizes these are the padded sizes of
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._columns: dict[torch.device, torch.Tensor] = {}
        self._padded = None
        return self

    @classmethod
    def of(cls, sizes: Sequence[int]) -> "GroupSizes":
        """``sizes`` itself when it is a :class:`GroupSizes` (its device tensors kept), else a new one."""
        return sizes if isinstance(sizes, GroupSizes) else cls(sizes)

    @property
    def total(self) -> int:
        return sum(self)

    def padded(self, multiple: int = BLOCK) -> "GroupSizes":
        """The sizes rounded up to multiples of ``multiple`` (16: the wgrad operands' padding);
        for 16 its offsets are this object's :meth:`padded_offsets` (no second copy)."""
        if multiple != BLOCK:
            return GroupSizes(-(-s // multiple) * multiple for s in self)
        if self._padded is None:
            if all(s % BLOCK == 0 for s in self):
                self._padded = self
            else:
                self._padded = GroupSizes(-(-s // BLOCK) * BLOCK for s in self)
                self._padded._base = self
        return self._padded

    def _device_offsets(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets, padded offsets), int32 ``[G + 1]`` each, on ``device`` (made once)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        hit = self._on.get(device)
        if hit is None:
            if self._base is not None:
                padded = self._base._device_offsets(device)[1]
                hit = (padded, padded)
            else:
                offsets, padded = [0], [0]
                for s in self:
                    offsets.append(offsets[-1] + s)
                    padded.append(padded[-1] + -(-s // BLOCK) * BLOCK)
                rows = torch.tensor([offsets, padded], dtype=torch.int32, pin_memory=device.type == "cuda")
                hit = tuple(rows.to(device, non_blocking=True).unbind(0))
            self._on[device] = hit
        return hit

    def offsets(self, device: torch.device | str) -> torch.Tensor:
        """int32 ``[G + 1]`` prefix offsets of the rows on ``device``."""
        return self._device_offsets(device)[0]

    def padded_offsets(self, device: torch.device | str) -> torch.Tensor:
        """int32 ``[G + 1]`` prefix offsets of the sizes padded to multiples of 16, on ``device``."""
        return self._device_offsets(device)[1]

    def column_index(self, device: torch.device | str) -> torch.Tensor:
        """int32 ``[T_pad]`` (``T_pad = padded().total``): the source row of each padded column
        (the groups' rows in order, each group followed by its zero padding), -1 for padding."""
        device = torch.device(device)
        hit = self._columns.get(device)
        if hit is None:
            t_pad = self.padded().total
            c = torch.arange(t_pad, dtype=torch.int32, device=device)
            if len(self) == 1:  # one group: its rows, then the padding (no offsets needed)
                hit = torch.where(c < self[0], c, -1)
            else:
                offsets, padded = self._device_offsets(device)
                group = torch.searchsorted(padded[1:], c, right=True)  # < G: every c < padded[G] = T_pad
                row = offsets.index_select(0, group) + (c - padded.index_select(0, group))
                hit = torch.where(row < offsets[1:].index_select(0, group), row, -1)
            self._columns[device] = hit
        return hit
