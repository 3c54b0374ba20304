"""refit_client: push weights from a Python trainer to refitd.

    from refit_client import RefitClient

    with RefitClient("unix:/run/refitd.sock", token_file="trainer.token") as client:
        result = client.push(model.state_dict(), label="step 100")
        print(result.version, result.fingerprint)

See docs/python.md in the refitd repository for the whole API.
"""

from ._attach import LAYOUT_FIELDS, AttachedEngine, EngineEvent, attach, safe_point_all
from ._client import DEFAULT_CHUNK_BYTES, EventStream, Refit, RefitClient, Tls
from ._fleet import FleetClient, FleetMemberResult, FleetRefitResult
from ._progress import TqdmProgress
from ._shm import shared_tensors
from ._tensors import TensorData, bf16
from .errors import (
    AlreadyExists,
    Cancelled,
    ChecksumMismatch,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    RefitConflict,
    RefitError,
    ResourceExhausted,
    StaleBaseVersion,
    Unavailable,
)
from .types import (
    AbortResult,
    ActiveRefit,
    EngineInfo,
    Health,
    MemoryUsage,
    ModelSummary,
    PhaseTimings,
    PushProgress,
    RefitResult,
    ReloadProgress,
    Status,
    TensorInfo,
    WatchEvent,
)

__version__ = "0.1.0"

__all__ = [
    "LAYOUT_FIELDS",
    "attach",
    "safe_point_all",
    "AttachedEngine",
    "EngineEvent",
    "TqdmProgress",
    "RefitClient",
    "FleetClient",
    "FleetMemberResult",
    "FleetRefitResult",
    "Refit",
    "Tls",
    "EventStream",
    "TensorData",
    "bf16",
    "shared_tensors",
    "DEFAULT_CHUNK_BYTES",
    "RefitError",
    "RefitConflict",
    "StaleBaseVersion",
    "ChecksumMismatch",
    "NotFound",
    "AlreadyExists",
    "OutOfRange",
    "PermissionDenied",
    "InvalidArgument",
    "FailedPrecondition",
    "ResourceExhausted",
    "Unavailable",
    "DeadlineExceeded",
    "Cancelled",
    "AbortResult",
    "ActiveRefit",
    "Health",
    "MemoryUsage",
    "ModelSummary",
    "PhaseTimings",
    "PushProgress",
    "RefitResult",
    "ReloadProgress",
    "Status",
    "EngineInfo",
    "TensorInfo",
    "WatchEvent",
]
