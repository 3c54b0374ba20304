"""Typed results of refit_client calls (plain dataclasses, no protobuf)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

__all__ = [
    "PhaseTimings",
    "RefitResult",
    "PushProgress",
    "ReloadProgress",
    "TensorInfo",
    "ModelSummary",
    "MemoryUsage",
    "ActiveRefit",
    "EngineInfo",
    "Status",
    "AbortResult",
    "WatchEvent",
    "Health",
]


@dataclasses.dataclass(frozen=True)
class PhaseTimings:
    """Seconds the daemon spent in each phase of a refit."""

    receive_seconds: float = 0.0
    quantize_seconds: float = 0.0
    finalize_seconds: float = 0.0
    commit_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class RefitResult:
    """What push(), commit() and reload() return.

    ``state`` is "COMMITTED", or "PREPARED" for push(prepare=True) (then
    ``version`` is the live version, unchanged until commit()).
    ``kept_layers`` received nothing and kept their values;
    ``partial_layers`` were received in part (allow_partial_layers only).
    ``unchanged``: the refit carried no tensors, so no new version was made
    (``version`` and ``fingerprint`` are the live ones).
    ``bytes_read_in_place``: of ``bytes_received``, the bytes of quantized
    weights the daemon read straight from a mapped shared-memory region
    (``lane="shm"`` with a sealed region) instead of copying them.
    ``scales_reused``: per-tensor FP8 weights whose scale was the same as in
    the group's last two refits, which the daemon's quantizer therefore read
    once instead of twice (the bytes do not depend on it).
    """

    refit_id: str
    state: str
    version: int
    fingerprint: str
    kept_layers: Tuple[str, ...] = ()
    partial_layers: Tuple[str, ...] = ()
    timings: PhaseTimings = PhaseTimings()
    bytes_received: int = 0
    peak_staging_bytes: int = 0
    unchanged: bool = False
    bytes_read_in_place: int = 0
    scales_reused: int = 0


@dataclasses.dataclass(frozen=True)
class PushProgress:
    """Passed to push()'s ``progress`` callback after every message sent."""

    bytes_sent: int
    tensors_done: int
    messages_sent: int
    elapsed_seconds: float
    # Known when push() got a mapping or a sequence; None for an iterator.
    tensors_total: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class ReloadProgress:
    """Passed to reload()'s ``progress`` callback (the daemon's Progress)."""

    refit_id: str
    state: str
    bytes_received: int
    elements_loaded: int
    elements_expected: int
    layers_done: int
    layers_total: int
    staging_bytes: int


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of tensors(): kernel layout (what engines read) or checkpoint
    layout (what a trainer pushes). ``dtype`` is "bf16", "fp16", "fp32",
    "fp8_e4m3", "i64", "i32" or "u8"."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    nbytes: int
    layer: str = ""
    optional: bool = False


@dataclasses.dataclass(frozen=True)
class ModelSummary:
    architecture: str
    num_layers: int
    tp_rank: int
    tp_size: int
    quantization: str
    checkpoint_dtype: str
    num_kernel_tensors: int
    kernel_bytes: int


@dataclasses.dataclass(frozen=True)
class MemoryUsage:
    kernel_bytes: int
    staging_bytes: int
    peak_staging_bytes: int
    staging_budget_bytes: int
    resident_bytes: int


@dataclasses.dataclass(frozen=True)
class ActiveRefit:
    """The refit in progress on a group (status().active_refit)."""

    refit_id: str
    state: str
    bytes_received: int
    elements_loaded: int
    elements_expected: int
    layers_done: int
    layers_total: int
    staging_bytes: int


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """An engine attached to a group (status().engines): its lease's id, the
    engine's process and user, whether the daemon waits for its safe points
    before each commit, when it attached, the last version it was told of,
    and the name it attached with (attach(name=...))."""

    engine_id: str
    pid: int
    uid: int
    coordinated: bool
    attached_unix_seconds: float
    version: int
    name: str = ""


@dataclasses.dataclass(frozen=True)
class Status:
    """status(): the served version of a model group and what the daemon
    holds. ``engines``: the engines attached to the group (refit_client.attach),
    in the order they attached."""

    model_group: str
    version: int
    fingerprint: str
    device: str
    ready: bool
    active_refit: Optional[ActiveRefit]
    memory: MemoryUsage
    model: ModelSummary
    last_commit_unix_seconds: float
    server_version: str
    engines: Tuple[EngineInfo, ...] = ()


@dataclasses.dataclass(frozen=True)
class AbortResult:
    refit_id: str
    version: int  # the live version, unchanged


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    """One event of watch(). ``type`` is "SNAPSHOT" (first event: the current
    state), "STAGING_STARTED", "PREPARED", "COMMITTED" or "ABORTED"."""

    type: str
    model_group: str
    refit_id: str
    version: int
    fingerprint: str
    message: str
    unix_seconds: float


@dataclasses.dataclass(frozen=True)
class Health:
    """health(): ``live`` is the daemon's liveness, ``ready`` its readiness (a
    version is loaded and it is not shutting down). Each is "SERVING",
    "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN"."""

    live: str
    ready: str

    @property
    def serving(self) -> bool:
        return self.live == "SERVING" and self.ready == "SERVING"
