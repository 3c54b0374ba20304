"""Exceptions of refit_client, one per gRPC status code a caller acts on.

Every error the daemon returns is raised as a subclass of RefitError that
carries the daemon's status code (``code``, a ``grpc.StatusCode``) and its
message (``message``, e.g. naming the tensor or the active refit). The class
says what to do next:

- RefitConflict (ABORTED): another refit is active, or this one was aborted;
  StaleBaseVersion (a RefitConflict) when the live version is not the
  base_version given: re-read status() and retry the read-modify-write.
- Unavailable: the daemon is unreachable or shutting down. For a push the
  answer may be what was lost, not the refit: check status() before pushing
  again (the client never retries a push by itself).
- InvalidArgument, FailedPrecondition, NotFound, ChecksumMismatch: fix the
  push. ResourceExhausted: the staging budget or a message limit.
"""

from __future__ import annotations

from typing import Optional

import grpc

__all__ = [
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
    "from_rpc_error",
]


class RefitError(Exception):
    """Base of every refit_client error: a status code and the daemon's message."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None) -> None:
        if code is not None:
            self.code = code
        self.message = message
        super().__init__(f"{self.code.name}: {message}")


class RefitConflict(RefitError):
    """ABORTED: another refit is active on the group (its id is in the
    message), the live version is not base_version, or the refit was aborted
    (Abort RPC, shutdown)."""

    code = grpc.StatusCode.ABORTED


class StaleBaseVersion(RefitConflict):
    """ABORTED because the live version is not the base_version given:
    re-read status().version and retry."""


class ChecksumMismatch(RefitError):
    """DATA_LOSS: a chunk's XXH3 did not match, or a tensor was sent only in part."""

    code = grpc.StatusCode.DATA_LOSS


class NotFound(RefitError):
    """NOT_FOUND: unknown tensor, refit id or model group."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(RefitError):
    """ALREADY_EXISTS: a byte range of a tensor was sent twice."""

    code = grpc.StatusCode.ALREADY_EXISTS


class OutOfRange(RefitError):
    """OUT_OF_RANGE: a chunk reaches past the end of its tensor."""

    code = grpc.StatusCode.OUT_OF_RANGE


class PermissionDenied(RefitError):
    """PERMISSION_DENIED (the token's role may not do this) or UNAUTHENTICATED
    (missing or unknown token); ``code`` tells which."""

    code = grpc.StatusCode.PERMISSION_DENIED


class InvalidArgument(RefitError, ValueError):
    """INVALID_ARGUMENT: a dtype, shape or option the daemon refuses, or a
    tensor this client cannot send (raised before anything is sent)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(RefitError):
    """FAILED_PRECONDITION: a layer missing whole tensors, or a commit of a
    refit still receiving."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(RefitError):
    """RESOURCE_EXHAUSTED: the daemon's staging budget or a message size limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(RefitError):
    """UNAVAILABLE: the daemon is unreachable, not serving, or shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(RefitError):
    """DEADLINE_EXCEEDED: the call's timeout passed, or the push stream was
    idle longer than the daemon's --push-idle-timeout."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(RefitError):
    """CANCELLED: the call was cancelled (by this client, e.g. a refit()
    block that raised)."""

    code = grpc.StatusCode.CANCELLED


_BY_CODE = {
    grpc.StatusCode.ABORTED: RefitConflict,
    grpc.StatusCode.DATA_LOSS: ChecksumMismatch,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRange,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDenied,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def error_for(code: grpc.StatusCode, message: str) -> RefitError:
    """The exception for a status code and message."""
    cls = _BY_CODE.get(code, RefitError)
    if cls is RefitConflict and "expects base version" in message:
        cls = StaleBaseVersion
    return cls(message, code)


def from_rpc_error(error: grpc.RpcError, what: str = "") -> RefitError:
    """Maps a grpc.RpcError (a failed call) to its RefitError."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    message = details or ""
    if code == grpc.StatusCode.UNAVAILABLE and what:
        message = f"{what}: {message}"
    return error_for(code or grpc.StatusCode.UNKNOWN, message)
