"""Progress bar and exact loss log for ``megatron.training`` runs.

Megatron 0.19 has no training callbacks; every iteration ends in ``training.training_log(...)``
with that iteration's (data-parallel averaged) losses in ``loss_dict``. :func:`install` wraps it
(the original still runs, so Megatron's own log lines, TensorBoard and W&B are unchanged) and, on
the last rank (where the loss lives):

* updates a ``tqdm`` bar with the iteration and the loss (``bar=True``);
* appends one JSON line per iteration to ``loss_log`` (``{"iteration": i, "lm loss": x}``,
  ``x`` written with ``repr`` so it round-trips exactly: tests compare resumed runs bitwise).
"""

from __future__ import annotations

import json
import math
from typing import Any

_state: dict[str, Any] = {}


def _is_last_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def _scalar(value: Any) -> float:
    if hasattr(value, "float"):
        value = value.float()
        return float(value.sum().item() / max(value.numel(), 1)) if value.numel() != 1 else float(value.item())
    return float(value)


def install(*, bar: bool = True, loss_log: str | None = None, total: int | None = None) -> None:
    """Wrap ``megatron.training.training.training_log`` (idempotent; call before ``pretrain``).

    ``total``: iterations for the bar (default: ``--train-iters``, read on the first call).
    """
    from megatron.training import training

    _state.update(bar_enabled=bar, loss_log=loss_log, total=total)
    if "original" in _state:
        return
    original = training.training_log
    _state["original"] = original

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs):
        result = original(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)
        if _is_last_rank() and loss_dict:
            _record(iteration, {k: _scalar(v) for k, v in loss_dict.items()})
        return result

    training_log.__wrapped__ = original
    training.training_log = training_log


def _record(iteration: int, losses: dict[str, float]) -> None:
    if _state.get("loss_log"):
        with open(_state["loss_log"], "a") as fh:
            fh.write(json.dumps({"iteration": int(iteration), **losses}) + "\n")
    if not _state.get("bar_enabled"):
        return
    bar = _state.get("bar")
    if bar is None:
        from megatron.training import get_args
        from tqdm.auto import tqdm

        args = get_args()
        total = _state.get("total") or args.train_iters
        bar = tqdm(total=total, initial=iteration - 1, desc="train", unit="it", dynamic_ncols=True)
        _state["bar"] = bar
    loss = losses.get("lm loss", next(iter(losses.values())))
    bar.set_postfix_str(f"loss {loss:.4f}" if math.isfinite(loss) else f"loss {loss}")
    bar.update(int(iteration) - bar.n)
    if bar.total is not None and bar.n >= bar.total:
        bar.close()
        _state.pop("bar")


def uninstall() -> None:
    """Restore Megatron's ``training_log`` (for tests)."""
    from megatron.training import training

    if "original" in _state:
        training.training_log = _state.pop("original")
    bar = _state.pop("bar", None)
    if bar is not None:
        bar.close()
