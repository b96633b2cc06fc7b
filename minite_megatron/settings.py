"""Every environment variable miniTE-Megatron reads, read in one place, once.

:func:`settings` returns a frozen :class:`Settings`: one field per variable, parsed and checked the
first time it is asked for and kept for the process (a bad value fails then, with one line naming
the variable). Nothing else in ``minite_megatron/`` or ``kernels/`` reads ``os.environ``
(``tests/test_settings.py`` walks them). A test that changes a variable calls
``settings.cache_clear()``; a test or benchmark that compares two values runs each inside
:func:`overridden` instead of touching the environment.

The few variables the package *sets* for other libraries go through :func:`export_default` and
:func:`unexport` (listed in :data:`EXPORTED`); :func:`environment` copies the environment for a
child process.

Layer 0 (``docs/architecture.md``): the standard library only, so every layer, the kernels
included, may read it. ``python -m minite_megatron.settings`` prints the table of
``docs/architecture.md`` (a test keeps the two equal).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field


class SettingsError(ValueError):
    """An environment variable holds a value it cannot have; the message names it."""


_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _bool(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(f"{name}={text!r}: expected one of {', '.join(_TRUE + _FALSE)}")


def _name(name: str, text: str) -> str:
    value = text.strip()
    if not value.replace("_", "").replace("-", "").isalnum():
        raise SettingsError(f"{name}={text!r}: expected a backend name (letters, digits, '_', '-')")
    return value


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        value = text.strip()
        if value not in choices:
            raise SettingsError(f"{name}={text!r}: expected one of {', '.join(choices)}")
        return value

    return parse


def _int_in(*allowed: int, minimum: int | None = None) -> Callable[[str, str], int]:
    def parse(name: str, text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise SettingsError(f"{name}={text!r}: expected an integer") from None
        if allowed and value not in allowed:
            raise SettingsError(f"{name}={text!r}: expected one of {', '.join(map(str, allowed))}")
        if minimum is not None and value < minimum:
            raise SettingsError(f"{name}={text!r}: expected an integer >= {minimum}")
        return value

    return parse


def _json_object(name: str, text: str) -> str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SettingsError(f"{name}: not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise SettingsError(f"{name}: expected a JSON object of recipe fields, got {type(value).__name__}")
    return text


def _var(env: str, default, kind: str, parse: Callable[[str, str], object], meaning: str):
    return field(default=default, metadata={"env": env, "kind": kind, "parse": parse, "meaning": meaning})


@dataclass(frozen=True)
class Settings:
    """The environment, parsed: one field per variable (``fields(Settings)`` metadata: ``env``,
    ``kind``, ``meaning``). An unset or empty variable takes the default."""

    backend: str | None = _var(
        "MINITE_BACKEND", None, "backend name", _name,
        "the NVFP4 backend `get_backend(None, device)` returns (`reference`, `triton`, `blackwell`, a registered"
        " one); unset: the best available for the device")
    strict_backend: str | None = _var(
        "MINITE_STRICT_BACKEND", None, "backend name", _name,
        "the backend whose `bi_*` kernels the batch-invariant ops run (`reference`: the torch formulation);"
        " unset: the device's default backend, as `MINITE_BACKEND` chooses it")
    attention_backward: str = _var(
        "MINITE_ATTENTION_BACKWARD", "direct", "direct / recompute", _choice("direct", "recompute"),
        "the batch-invariant attention's backward: torch's fused SDPA backward on the forward's output and"
        " log-sum-exp, or a recompute of the forward through SDPA")
    megatron_combine: bool = _var(
        "MINITE_MEGATRON_COMBINE", False, "bool", _bool,
        "default mode keeps Megatron's atomic MoE combine instead of the deterministic one (a benchmark's"
        " before/after)")
    recipe_json: str | None = _var(
        "MINITE_RECIPE", None, "JSON object", _json_object,
        "the recipe of Transformer Engine's default quantizer factory (`te.quantizer_factory.qfactory`), as"
        " `Recipe.from_dict` JSON; unset: `Recipe()`")
    blackwell_mma_k: int | None = _var(
        "MINITE_BLACKWELL_MMA_K", None, "64 / 96", _int_in(64, 96),
        "the CuTe DSL GEMMs' MMA K (`64` forces the K = 64 kernel on sm_103a; `96` exists on sm_103a only);"
        " unset: by the GPU")
    triton_interpret: bool = _var(
        "TRITON_INTERPRET", False, "bool", _bool,
        "Triton's own switch, read with its rule: kernels run in Triton's interpreter on CPU tensors (CI)")
    world_size: int = _var(
        "WORLD_SIZE", 1, "int >= 1", _int_in(minimum=1),
        "torchrun's number of processes (the checkpoint converter's parallel state)")
    local_rank: int = _var(
        "LOCAL_RANK", 0, "int >= 0", _int_in(minimum=0),
        "torchrun's rank of this process on its node (the converter's GPU)")

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Parse ``environ`` (default ``os.environ``). Raises :class:`SettingsError` naming the
        first variable with a bad value."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            text = environ.get(f.metadata["env"], "")
            if text.strip():
                values[f.name] = f.metadata["parse"](f.metadata["env"], text)
        return cls(**values)


_READ: list[Settings] = []  # the environment's, once read
_SCOPED: list[Settings] = []  # overridden() blocks, innermost last (process-wide: autograd runs on other threads)


def settings() -> Settings:
    """The process's :class:`Settings` (read on the first call; an :func:`overridden` block's inside it)."""
    if _SCOPED:
        return _SCOPED[-1]
    if not _READ:
        _READ.append(Settings.read())
    return _READ[0]


def _cache_clear() -> None:
    """Read the environment again at the next :func:`settings` call (tests that set a variable)."""
    _READ.clear()


settings.cache_clear = _cache_clear


@contextlib.contextmanager
def overridden(**changes) -> Iterator[Settings]:
    """The settings with ``changes`` (field names, e.g. ``strict_backend="triton"``) inside the
    block, for the whole process; the previous ones after. Raises TypeError for an unknown field."""
    scoped = dataclasses.replace(settings(), **changes)
    _SCOPED.append(scoped)
    try:
        yield scoped
    finally:
        _SCOPED.remove(scoped)


#: Variables the package sets for other libraries: ``(name, value, who reads it and why)``.
EXPORTED = (
    ("CUDA_DEVICE_MAX_CONNECTIONS", "1", "Megatron-Core asserts it for its overlap paths; `cpu_compat.activate()`"
                                          " sets it on a machine without a GPU where it is unset, `deactivate()` removes it"),
    ("NO_VCS_VERSION", "1", "megatron-core's version lookup skips git (`training.upstream_warnings.install()`),"
                            " unless the environment says otherwise"),
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "0", "`minite-diagnose vllm` runs vLLM's engine in its own process, so the"
                                            " tracer's hooks reach the model (`export`: always, whatever was set)"),
)


def export_default(name: str, value: str) -> bool:
    """Set ``name`` (one of :data:`EXPORTED`) to ``value`` unless it is set; True if it was set here."""
    if name not in {e[0] for e in EXPORTED}:
        raise ValueError(f"settings.export_default: {name!r} is not listed in settings.EXPORTED")
    if name in os.environ:
        return False
    os.environ[name] = value
    return True


def export(name: str, value: str) -> str | None:
    """Set ``name`` (one of :data:`EXPORTED`) to ``value`` whatever it was; the previous value (None: unset)."""
    if name not in {e[0] for e in EXPORTED}:
        raise ValueError(f"settings.export: {name!r} is not listed in settings.EXPORTED")
    previous = os.environ.get(name)
    os.environ[name] = value
    return previous


def unexport(name: str) -> None:
    """Remove ``name`` (one :func:`export_default` set) from the environment."""
    os.environ.pop(name, None)


def environment(without: tuple[str, ...] = ()) -> dict[str, str]:
    """A copy of the environment without the variables ``without`` (a child process's)."""
    return {k: v for k, v in os.environ.items() if k not in without}


def table() -> str:
    """The Markdown table of every variable (``docs/architecture.md`` holds it verbatim)."""
    rows = ["| variable | field | values | default | what it does |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(Settings):
        default = "unset" if f.default is None else f"`{f.default}`"
        rows.append(f"| `{f.metadata['env']}` | `{f.name}` | {f.metadata['kind']} | {default} | {f.metadata['meaning']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
