"""The group sizes of a grouped (MoE) GEMM, and the index tensors its kernels read.

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

:class:`DeviceGroupSizes` is the same interface for counts that never reach the host (the MoE
layer without its routing wait, TP = EP = 1: ``modules.moe``): an int tensor ``[G]`` of counts on
the device and the host-known total T (the rows of the tokens it describes). Its offsets are
summed on the device; the wgrad operands' width is the bound ``T_pad <= T + 15 G`` rounded up to a
multiple of 16 (the columns past the padded groups are -1 in the column index: zero columns,
which change neither an amax nor a GEMM: the same bits as the exact width).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .formats import BLOCK


def _padded_column_index(c: torch.Tensor, offsets: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
    """int32: the source row of each padded column ``c`` (int32, on the offsets' device) of groups
    with row offsets ``offsets`` and padded offsets ``padded`` (int32 ``[G + 1]``, G >= 1), -1 for
    a group's padding and for columns past the last group (a width bound beyond ``padded[G]``)."""
    # the group of column c (c past the last group: the last group, whose rows it is beyond)
    group = torch.searchsorted(padded[1:], c, right=True, out_int32=True).clamp_(max=offsets.numel() - 2)
    row = offsets.index_select(0, group) + (c - padded.index_select(0, group))
    return torch.where(row < offsets[1:].index_select(0, group), row, -1)


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
    def of(cls, sizes: "Sequence[int] | DeviceGroupSizes") -> "GroupSizes | DeviceGroupSizes":
        """``sizes`` itself when it is a :class:`GroupSizes` or a :class:`DeviceGroupSizes` (its
        device tensors kept), else a new :class:`GroupSizes`."""
        return sizes if isinstance(sizes, (GroupSizes, DeviceGroupSizes)) else cls(sizes)

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
                hit = _padded_column_index(c, *self._device_offsets(device))
            self._columns[device] = hit
        return hit


class DeviceGroupSizes:
    """Group sizes that stay on the device: ``counts`` (an int tensor ``[G]``) and ``rows``, their
    total T, known on the host (module docstring). The interface of :class:`GroupSizes` a grouped
    kernel uses, without a host synchronization::

        len(sizes)              G
        total                   T (``padded()``: the padded width, a multiple of 16)
        offsets(device)         int32 [G + 1]   prefix offsets, summed on the device
        padded()                the sizes rounded up to multiples of 16 (offsets: padded_offsets)
        padded_offsets(device)  int32 [G + 1]
        column_index(device)    int32 [width]   padded column -> source row, -1 for padding
        width                   ceil16(T + 15 G): the padded width's bound, what the wgrad operands use

    Iterating raises TypeError (the values are not on the host); :meth:`tolist` brings them there
    (a device-to-host copy and a wait: for a caller that needs host sizes, e.g. Megatron's
    ``TEGroupedMLP.forward``). Construction checks ``counts`` (1-D, integer) on the host and that
    they are non-negative and sum to ``rows`` on the device (``torch._assert_async``: no host
    wait on a GPU, where a failure surfaces at a later launch; raises RuntimeError at once on a CPU).
    Sizes and offsets must stay below 2**31 (int32).
    """

    def __init__(self, counts: torch.Tensor, rows: int, *, check: bool = True):
        if not torch.is_tensor(counts) or counts.dim() != 1 or counts.dtype.is_floating_point or counts.dtype == torch.bool:
            raise ValueError(f"DeviceGroupSizes: counts must be a 1-D integer tensor, got "
                             f"{getattr(counts, 'dtype', type(counts))} {tuple(getattr(counts, 'shape', ()))}")
        rows = int(rows)
        if rows < 0:
            raise ValueError(f"DeviceGroupSizes: rows must be >= 0, got {rows}")
        self.counts = counts
        self.rows = rows
        groups = counts.numel()
        self.width = -(-(rows + (BLOCK - 1) * groups) // BLOCK) * BLOCK
        self._padded_view = False
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._columns: dict[torch.device, torch.Tensor] = {}
        self._padded: DeviceGroupSizes | None = None
        if check and groups:
            ok = (counts.sum() == rows) & (counts.min() >= 0)
            torch._assert_async(ok, f"DeviceGroupSizes: the {groups} counts must be >= 0 and sum to {rows} rows")
        elif check and rows:
            raise ValueError(f"DeviceGroupSizes: no groups for {rows} rows")

    def __len__(self) -> int:
        return self.counts.numel()

    def __iter__(self):
        raise TypeError("DeviceGroupSizes: the sizes are on the device (iterating would wait for it); "
                        "call tolist() where host sizes are needed")

    def __repr__(self) -> str:
        kind = "padded " if self._padded_view else ""
        return f"DeviceGroupSizes({kind}{len(self)} groups, {self.rows} rows, width {self.width}, on {self.counts.device})"

    @property
    def device(self) -> torch.device:
        return self.counts.device

    @property
    def total(self) -> int:
        """T, the rows (for :meth:`padded`: the width bound, the padded operands' column count)."""
        return self.width if self._padded_view else self.rows

    def tolist(self) -> list[int]:
        """The sizes as host ints: a device-to-host copy and a wait on a GPU (the padded view:
        the padded sizes)."""
        counts = self.counts.tolist()
        return [-(-c // BLOCK) * BLOCK for c in counts] if self._padded_view else counts

    def padded(self, multiple: int = BLOCK) -> "DeviceGroupSizes":
        """The sizes rounded up to multiples of 16 (the same object for a padded view): its
        offsets are :meth:`padded_offsets`, its total the width bound. Raises ValueError for another
        ``multiple``."""
        if multiple != BLOCK:
            raise ValueError(f"DeviceGroupSizes pads to multiples of {BLOCK}, not {multiple}")
        if self._padded_view:
            return self
        if self._padded is None:
            view = DeviceGroupSizes(self.counts, self.rows, check=False)
            view._padded_view, view._on = True, self._on
            self._padded = view
        return self._padded

    def _device_offsets(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets, padded offsets), int32 ``[G + 1]`` each, on ``device`` (made once, on the device)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        hit = self._on.get(device)
        if hit is None:
            c = self.counts.to(device=device, dtype=torch.int32)
            both = torch.stack([c, (c + (BLOCK - 1)) // BLOCK * BLOCK])
            both = torch.nn.functional.pad(torch.cumsum(both, 1, dtype=torch.int32), (1, 0))
            hit = tuple(both.unbind(0))
            self._on[device] = hit
        return hit

    def offsets(self, device) -> torch.Tensor:
        """int32 ``[G + 1]`` prefix offsets on ``device`` (the padded view: the padded ones)."""
        return self._device_offsets(device)[1 if self._padded_view else 0]

    def padded_offsets(self, device) -> torch.Tensor:
        """int32 ``[G + 1]`` prefix offsets of the sizes padded to multiples of 16."""
        return self._device_offsets(device)[1]

    def column_index(self, device) -> torch.Tensor:
        """int32 ``[width]``: the source row of each padded column (the groups' rows in order,
        each followed by its zero padding), -1 for padding and for the columns past the last
        group; on its first :meth:`padded` columns equal to :meth:`GroupSizes.column_index`."""
        device = torch.device(device)
        hit = self._columns.get(device)
        if hit is None:
            c = torch.arange(self.width, dtype=torch.int32, device=device)
            if len(self) == 0:
                hit = torch.full_like(c, -1)
            else:
                hit = _padded_column_index(c, *self._device_offsets(device))
            self._columns[device] = hit
        return hit
