"""CPU compatibility layer: lets real Megatron-Core train and generate with tiny models on a
machine without a GPU (development, CI, the README's main job).

Checked against megatron-core 0.19.2 (:data:`CHECKED_MEGATRON_CORE`) and torch 2.11.

``activate()`` does nothing and returns ``False`` when ``torch.cuda.is_available()``: GPU runs are
never touched. On a CPU-only machine it is idempotent, logs one line, and redirects the CUDA uses
that Megatron hard-codes. The principle: it only replaces what *raises* on a CPU-only machine,
what silently skips work Megatron needs, or what behaves differently because the CPU now stands
in for the GPU (the generator, ``Tensor.type()`` names); no working CPU code path is changed.
Every redirect is listed in :data:`REDIRECTS` (target, attribute, why); ``tests/megatron/
test_cpu_compat*.py`` fails loudly if a future Megatron moves or removes one of them.

What it does, and why
=====================
Device placement
    * A ``TorchFunctionMode`` (:class:`CudaToCpuMode`) maps CUDA device arguments of any torch
      call (``device="cuda"``, ``"cuda:N"``, ``torch.device("cuda")`` or an ordinal) to the CPU,
      makes ``Tensor.cuda()`` / ``Tensor.pin_memory()`` return the tensor itself and drops
      ``pin_memory=True``; ``Tensor.type()`` reports ``torch.cuda.*Tensor`` names (Megatron's
      optimizer and gradient clipping assert them). ``megatron.training`` alone writes
      ``device='cuda'`` in ~40 places
      (loss buffers, all-reduced flags, timers) and scripts call ``batch.cuda()``; a mode is torch's
      public hook for exactly this. Cost: ~1-3 us per torch call (measured on this machine).
      The mode is pushed on the activating thread's torch-function stack (torch keeps that stack
      per thread; CPU autograd runs backward on the calling thread).
    * ``torch.cuda.current_device`` -> ``torch.cpu.current_device`` (returns ``"cpu"``): used as a
      ``device=`` argument all over megatron-core (RoPE, attention masks, embeddings init, TP
      mappings, all-to-all output buffers, router aux losses, batch broadcast).
Streams and events (MoE all-to-all dispatcher, DDP, timers)
    * ``torch.cuda.Stream / Event / current_stream / stream / synchronize`` -> thin wrappers over
      ``torch.cpu``'s device-agnostic no-op versions (they accept and ignore ``device=``); events
      with ``enable_timing`` measure wall-clock time (``elapsed_time``, used by the static
      inference engine's step timing).
RNG
    * Megatron's model-parallel RNG tracker swaps CUDA generator states. On a CPU machine the
      generator that dropout and ``init`` use is the CPU default generator, so the tracker class
      becomes :class:`CpuRNGStatesTracker` and ``random._get_cuda_rng_state`` /
      ``random._set_cuda_rng_state`` (used by ``fork`` and activation recomputation) get and set
      the CPU generator. ``torch.cuda.get_rng_state`` (checkpoint save) returns the CPU state;
      ``torch.cuda.set_rng_state`` is left alone (it is already a lazy no-op without CUDA).
MoE token dispatcher (gloo)
    * ``token_dispatcher.maybe_move_tensor_to_cpu``: on a GPU the all-to-all split sizes are
      copied to host numpy arrays; on CPU tensors the upstream function skips that copy, and
      gloo's ``all_to_all_single`` rejects tensor split sizes. The replacement converts CPU
      tensors to numpy when asked (``as_numpy=True``), as the GPU path does.
megatron.training
    * ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless ``allow_no_cuda``: the
      replacement passes ``allow_no_cuda=True`` (in ``megatron.training``, its ``initialize`` and
      its ``training`` module, where ``pretrain`` looks it up).
    * ``initialize._initialize_distributed`` and ``initialize._set_random_seed`` skip model-parallel
      initialization and the RNG-tracker seeding when ``torch.cuda.device_count() == 0``: they run
      with one pseudo device visible (``device_count() == 1``, ``set_device`` a no-op) for the
      duration of the call only. ``torch.cuda.is_available()`` is unaffected.
    * ``arguments.get_device_arch_version`` (the CUDA major version; TP/CP argument checks call it)
      returns 0, and ``CUDA_DEVICE_MAX_CONNECTIONS=1`` is set if unset, which the check for
      pre-Blackwell GPUs then asks for (it orders CUDA streams; meaningless, harmless on a CPU).
    * ``training.build_train_valid_test_data_iterators``: creating a ``DataLoader`` iterator draws
      its base seed from the CPU default generator. On a GPU that generator is not the one dropout
      uses; here it is, and ``pretrain`` builds the iterators *after* loading a checkpoint, so a
      resumed run would see its dropout stream shifted by that draw. The replacement restores the
      CPU generator's state after building the iterators (the loaders still get their seeds).
Fusions
    * ``megatron.core.jit.jit_fuser`` is ``torch.compile``: on a 2-core CPU each fused function
      costs ~20 s to compile (measured) and needs a C++ tool-chain. ``activate`` calls Megatron's
      own ``disable_jit_fuser()`` (later imports get plain functions) and replaces the already
      compiled wrappers in imported ``megatron.*`` modules by their eager originals
      (``_torchdynamo_orig_callable``). The math is the same up to bf16 rounding inside fusions.

Not covered (raise a clear error or are not needed for tiny CPU runs): ``--moe-grouped-gemm``
(Megatron's argument check asks for the device capability), CUDA graphs, TE, the dynamic
inference engine (pinned memory, flash-attention kernels), NCCL, ``--log-memory`` stats.
Use ``--distributed-backend gloo`` (the launcher sets it by default on CPU).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from .settings import export_default, unexport

logger = logging.getLogger(__name__)

CHECKED_MEGATRON_CORE = "0.19.2"
"""The megatron-core version every redirect below was read from and tested against."""


@dataclass(frozen=True)
class Redirect:
    """One attribute that :func:`activate` replaces: ``getattr(import_module(target), attr)``."""

    target: str
    attr: str
    why: str


REDIRECTS: tuple[Redirect, ...] = (
    Redirect("torch.cuda", "current_device", "used as device= all over megatron-core; raises without a driver"),
    Redirect("torch.cuda", "Stream", "MoE all-to-all dispatcher D2H stream, DDP stream; raises without a driver"),
    Redirect("torch.cuda", "Event", "MoE delayed wgrad, static inference step timing; raises without a driver"),
    Redirect("torch.cuda", "current_stream", "stream bookkeeping in the MoE dispatcher and DDP"),
    Redirect("torch.cuda", "stream", "stream context in the MoE dispatcher and DDP"),
    Redirect("torch.cuda", "synchronize", "timers, parallel_state, checkpointing; raises without a driver"),
    Redirect("torch.cuda", "get_rng_state", "checkpoint save stores the device RNG; raises without a driver"),
    Redirect(
        "megatron.core.tensor_parallel.random", "CudaRNGStatesTracker", "tracker class built by initialize_rng_tracker"
    ),
    Redirect("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", "tracker fork and activation recompute"),
    Redirect("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", "tracker fork and activation recompute"),
    Redirect(
        "megatron.core.transformer.moe.token_dispatcher",
        "maybe_move_tensor_to_cpu",
        "gloo all_to_all_single needs host split sizes",
    ),
    Redirect("megatron.training.training", "initialize_megatron", "asserts CUDA unless allow_no_cuda (pretrain's)"),
    Redirect("megatron.training.initialize", "initialize_megatron", "asserts CUDA unless allow_no_cuda"),
    Redirect("megatron.training", "initialize_megatron", "asserts CUDA unless allow_no_cuda (scripts' import)"),
    Redirect(
        "megatron.training.initialize", "_initialize_distributed", "mpu init gated on torch.cuda.device_count() > 0"
    ),
    Redirect("megatron.training.initialize", "_set_random_seed", "RNG tracker seeding gated on device_count() > 0"),
    Redirect(
        "megatron.training.arguments",
        "get_device_arch_version",
        "argument checks for TP/CP ask the GPU architecture; raises without a driver",
    ),
    Redirect(
        "megatron.training.training",
        "build_train_valid_test_data_iterators",
        "data loaders draw their seed from the CPU generator, which stands in for the device one",
    ),
)
"""Every attribute the layer replaces while active (also: the device mode, and jit fusions)."""

_lock = threading.Lock()
_active = False
_originals: list[tuple[Any, str, Any]] = []
_mode: "CudaToCpuMode | None" = None
_unwrapped: list[tuple[Any, str, Any]] = []
_env_set: list[str] = []


def is_active() -> bool:
    """True while the CPU compatibility layer is active in this process."""
    return _active


# --------------------------------------------------------------------------- device placement
def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # an ordinal names a CUDA device
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


_CPU = torch.device("cpu")


def _tensor_type(func, args, kwargs):
    """``Tensor.type()`` names CPU tensors as CUDA ones (Megatron's optimizer and grad clipping
    assert ``param.grad.type() == 'torch.cuda.FloatTensor'``); ``Tensor.type('torch.cuda.X')``
    converts to ``torch.X``."""
    if len(args) == 1 and not kwargs:
        name = func(*args)
        if name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch.") :]
        return name
    dtype = kwargs.pop("dtype", args[1] if len(args) > 1 else None)
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        dtype = "torch." + dtype[len("torch.cuda.") :]
    return func(args[0], dtype, **kwargs)


class CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments of every torch call to the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type:
            return _tensor_type(func, args, kwargs)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- torch.cuda stand-ins
class CpuEvent(torch.cpu.Event):
    """``torch.cuda.Event`` stand-in: accepts CUDA's constructor arguments; waits are no-ops (CPU
    work is synchronous, so an event is complete when recorded). With ``enable_timing=True``,
    ``record()`` takes ``time.perf_counter()`` and ``elapsed_time(end)`` returns milliseconds, as a
    CUDA event does (Megatron's static generation loop times every step this way); asking an
    event without timing, or one not recorded yet, raises ``RuntimeError`` like CUDA does."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        super().__init__()
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def elapsed_time(self, end_event: "CpuEvent") -> float:
        if not (self.enable_timing and getattr(end_event, "enable_timing", False)):
            raise RuntimeError("Both events must be created with enable_timing=True to measure elapsed time")
        if self._t is None or end_event._t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        return (end_event._t - self._t) * 1000.0


class CpuStream(torch.cpu.Stream):
    """``torch.cuda.Stream`` stand-in: accepts ``device=``/``priority=``; CPU work is synchronous,
    so waits are no-ops and ``record_event`` returns a (completed) :class:`CpuEvent`."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
        super().__init__()

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        return event if event is not None else CpuEvent()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_DEFAULT_STREAM = CpuStream()


def _current_stream(device: Any = None) -> CpuStream:
    stream = torch.cpu.current_stream()
    return stream if isinstance(stream, CpuStream) else _DEFAULT_STREAM


def _stream_context(stream: Any = None):
    return torch.cpu.stream(stream if isinstance(stream, torch.cpu.Stream) else None)


def _synchronize(device: Any = None) -> None:
    return None


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Megatron's ``_get_cuda_rng_state`` for a CPU machine: the CPU default generator's state."""
    return torch.get_rng_state()


def _cpu_set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Megatron's ``_set_cuda_rng_state`` for a CPU machine: sets the CPU default generator."""
    torch.set_rng_state(new_state)


_tracker_classes: dict[type, type] = {}


def _make_cpu_tracker_class(base: type) -> type:
    """The CPU tracker class for Megatron's tracker class ``base`` (built once per base)."""
    if base not in _tracker_classes:
        _tracker_classes[base] = _build_cpu_tracker_class(base)
    return _tracker_classes[base]


def _build_cpu_tracker_class(base: type) -> type:
    class CpuRNGStatesTracker(base):
        """Megatron's model-parallel RNG tracker with the CPU default generator standing in for
        the CUDA one (same names, seeds and fork semantics; no CUDA graphs)."""

        def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
            if use_cudagraphable_rng:
                raise RuntimeError("CUDA-graph-safe RNG (cuda_graph_impl != 'none') needs a GPU")
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=is_inference_rng_tracker)

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
            self.states_[name] = gen.get_state()

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng"):
            # Upstream's fork, minus its "CPU RNG state changed" warning: here the CPU generator
            # *is* the device generator, so ops inside the fork are expected to advance it.
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                if self._current_state_name != name:
                    raise Exception(
                        f"current state name {self._current_state_name} is not the same as the desired "
                        f"state name {name}."
                    )
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


def _cpu_maybe_move_tensor_to_cpu(original: Callable) -> Callable:
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


@contextlib.contextmanager
def _one_pseudo_device():
    """Within the block, ``torch.cuda.device_count() == 1`` and ``set_device`` is a no-op."""
    cuda = torch.cuda
    saved = (cuda.device_count, cuda.set_device)
    cuda.device_count = lambda: 1
    cuda.set_device = lambda device: None
    try:
        yield
    finally:
        cuda.device_count, cuda.set_device = saved


def _with_pseudo_device(original: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        with _one_pseudo_device():
            return original(*args, **kwargs)

    wrapper.__wrapped__ = original
    wrapper.__name__ = getattr(original, "__name__", "wrapper")
    return wrapper


def _keep_device_rng(original: Callable) -> Callable:
    def build_train_valid_test_data_iterators(*args, **kwargs):
        state = torch.get_rng_state()
        try:
            return original(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    build_train_valid_test_data_iterators.__wrapped__ = original
    return build_train_valid_test_data_iterators


def _no_gpu_arch() -> int:
    """``get_device_arch_version`` without a GPU: 0 (no architecture)."""
    return 0


def _allow_no_cuda(original: Callable) -> Callable:
    def initialize_megatron(*args, **kwargs):
        if args:  # allow_no_cuda is the first parameter
            args = (True, *args[1:])
        else:
            kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize_megatron.__wrapped__ = original
    return initialize_megatron


# --------------------------------------------------------------------------- activation
def _replacements() -> dict[tuple[str, str], Callable[[Any], Any]]:
    """(target, attr) -> function(original) returning the replacement."""
    return {
        ("torch.cuda", "current_device"): lambda orig: torch.cpu.current_device,
        ("torch.cuda", "Stream"): lambda orig: CpuStream,
        ("torch.cuda", "Event"): lambda orig: CpuEvent,
        ("torch.cuda", "current_stream"): lambda orig: _current_stream,
        ("torch.cuda", "stream"): lambda orig: _stream_context,
        ("torch.cuda", "synchronize"): lambda orig: _synchronize,
        ("torch.cuda", "get_rng_state"): lambda orig: _get_rng_state,
        ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker"): _make_cpu_tracker_class,
        ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"): lambda orig: _cpu_get_cuda_rng_state,
        ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"): lambda orig: _cpu_set_cuda_rng_state,
        ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu"): _cpu_maybe_move_tensor_to_cpu,
        ("megatron.training.training", "initialize_megatron"): _allow_no_cuda,
        ("megatron.training.initialize", "initialize_megatron"): _allow_no_cuda,
        ("megatron.training", "initialize_megatron"): _allow_no_cuda,
        ("megatron.training.initialize", "_initialize_distributed"): _with_pseudo_device,
        ("megatron.training.initialize", "_set_random_seed"): _with_pseudo_device,
        ("megatron.training.arguments", "get_device_arch_version"): lambda orig: _no_gpu_arch,
        ("megatron.training.training", "build_train_valid_test_data_iterators"): _keep_device_rng,
    }


def check_redirect_targets() -> list[str]:
    """Problems with :data:`REDIRECTS` in the installed Megatron (empty when all are in place).

    Reports a target module that does not import or an attribute that no longer exists; the
    test-suite asserts this list is empty so that a Megatron upgrade that moves a patched
    attribute fails loudly instead of silently running CUDA code on a CPU.
    """
    problems = []
    table = _replacements()
    for r in REDIRECTS:
        if (r.target, r.attr) not in table:
            problems.append(f"{r.target}.{r.attr}: listed but has no replacement")
        try:
            mod = importlib.import_module(r.target)
        except Exception as e:  # noqa: BLE001 - report any import failure
            problems.append(f"{r.target}: cannot import ({type(e).__name__}: {e})")
            continue
        obj = mod
        if not hasattr(obj, r.attr):
            problems.append(f"{r.target}.{r.attr}: attribute missing (Megatron moved it?)")
    import megatron.core.jit as jit

    if not callable(getattr(jit, "disable_jit_fuser", None)):
        problems.append("megatron.core.jit.disable_jit_fuser: missing")
    return problems


def _megatron_version() -> str:
    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except Exception:  # noqa: BLE001
        return "unknown"


def _unwrap_compiled_fusions() -> int:
    """Replace torch.compile wrappers in imported ``megatron.*`` modules by their originals."""
    count = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("megatron.") or mod is None:
            continue
        holders = [mod] + [v for v in vars(mod).values() if isinstance(v, type) and v.__module__ == name]
        for holder in holders:
            for attr, value in list(vars(holder).items()):
                orig = getattr(value, "_torchdynamo_orig_callable", None)
                if orig is not None and callable(value):
                    _unwrapped.append((holder, attr, value))
                    setattr(holder, attr, orig)
                    count += 1
    return count


def activate() -> bool:
    """Activate the layer on a CPU-only machine; returns whether it is active.

    Returns ``False`` (and changes nothing) when ``torch.cuda.is_available()``. Idempotent.
    Logs one line when it activates. Raises ``ImportError`` if megatron-core is missing.
    """
    global _active, _mode
    if torch.cuda.is_available():
        return False
    with _lock:
        if _active:
            return True
        import megatron.core.jit as jit

        jit.disable_jit_fuser()
        table = _replacements()
        for r in REDIRECTS:
            mod = importlib.import_module(r.target)
            original = getattr(mod, r.attr)
            _originals.append((mod, r.attr, original))
            setattr(mod, r.attr, table[(r.target, r.attr)](original))
        import megatron.core.tensor_parallel.random as mrandom

        if mrandom._CUDA_RNG_STATE_TRACKER is not None and not isinstance(
            mrandom._CUDA_RNG_STATE_TRACKER, mrandom.CudaRNGStatesTracker
        ):
            mrandom._CUDA_RNG_STATE_TRACKER = None
            mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
        unwrapped = _unwrap_compiled_fusions()
        if export_default("CUDA_DEVICE_MAX_CONNECTIONS", "1"):
            _env_set.append("CUDA_DEVICE_MAX_CONNECTIONS")
        _mode = CudaToCpuMode()
        _mode.__enter__()
        _active = True
        version = _megatron_version()
        note = "" if version.startswith(CHECKED_MEGATRON_CORE) else f" (checked against {CHECKED_MEGATRON_CORE}!)"
        # a warning only when megatron-core is a version the redirect table was not checked against
        logger.log(
            logging.WARNING if note else logging.INFO,
            "minite cpu_compat: no CUDA GPU; running megatron-core %s on CPU: %d CUDA uses redirected, "
            "CUDA device arguments mapped to CPU, %d torch.compile fusions run eagerly%s",
            version,
            len(REDIRECTS),
            unwrapped,
            note,
        )
        return True


@contextlib.contextmanager
def activated():
    """Context manager: the layer active inside (if there is no GPU); afterwards as it was."""
    was_active = _active
    activate()
    try:
        yield _active
    finally:
        if not was_active:
            deactivate()


def deactivate() -> None:
    """Undo :func:`activate` (for tests); must run on the thread that activated."""
    global _active, _mode
    with _lock:
        if not _active:
            return
        if _mode is not None:
            _mode.__exit__(None, None, None)
            _mode = None
        for mod, attr, original in reversed(_originals):
            setattr(mod, attr, original)
        _originals.clear()
        for name in _env_set:
            unexport(name)
        _env_set.clear()
        for holder, attr, value in reversed(_unwrapped):
            setattr(holder, attr, value)
        _unwrapped.clear()
        # The tracker instance (a CPU tracker, with its seeded states) is kept: it is the only
        # tracker that works on this machine, and tests that re-activate keep their states.
        import megatron.core.jit as jit

        jit.enable_jit_fuser()
        _active = False
