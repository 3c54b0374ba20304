"""RefitClient: the Python trainer client of refitd (refit.v1 over gRPC)."""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import secrets
import threading
import time
from typing import (
    Any,
    Callable,
    Deque,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import grpc
import numpy as np
import xxhash

from . import _health, _shm, _tensors
from ._proto import refit_pb2 as pb
from ._proto import refit_pb2_grpc as pb_grpc
from .errors import (
    DeadlineExceeded,
    InvalidArgument,
    RefitConflict,
    RefitError,
    Unavailable,
    error_for,
    from_rpc_error,
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

__all__ = ["RefitClient", "Refit", "Tls", "EventStream"]

DEFAULT_CHUNK_BYTES = 4 << 20
# 4 MiB messages, not the C++ client's 32 MiB: the protobuf runtime (upb)
# serializes a message's bytes at a cost per byte that grows with the
# message's size and its number of chunks (about 0.08 s/GiB for one 4 MiB
# chunk, 1.4 s/GiB for four in a 16 MiB message), and serializing is most of
# a push's CPU in Python. bench/python/push_bench.py measures it.
DEFAULT_BUCKET_BYTES = 4 << 20
DEFAULT_TIMEOUT = 30.0
# push(lane="auto") takes the shared-memory lane only when it copies at most
# this many bytes into the client's staging region (which stays allocated).
DEFAULT_SHM_STAGING_LIMIT = 4 << 30
_MAX_MESSAGE_BYTES = 256 << 20
# Messages a refit may have queued for gRPC's sender: bounds the client's
# memory to about (depth + 1) buckets whatever the model's size.
_QUEUE_DEPTH = 2
# Chunk size of the shared-memory lane when push() is given the default
# (references cost nothing per byte; below the daemon's --max-chunk-bytes).
_SHM_CHUNK_BYTES = 32 << 20
# Referenced bytes per message of the shared-memory lane when push() is given
# the default bucket: a reference costs the same whatever its length, so a
# message per few MiB would cost both ends a gRPC round per tensor (about
# half the client's CPU of a push of 1 GiB in ~400 tensors); a message per
# 64 MiB still hands the daemon a layer or so at a time.
_SHM_BUCKET_BYTES = 64 << 20
# Region chunks per message at most (the shared-memory lane's messages
# carry references only, so a bucket of small tensors stays small).
_MAX_REGION_CHUNKS = 1024
# Encoded region chunks a client keeps (_send_region's cache), at most.
_REGION_CHUNK_CACHE = 1 << 16
_LANES = ("auto", "shm", "grpc")
# How long an abandoned refit() waits for the daemon to confirm the abort
# before it cancels the call instead.
_ABANDON_WAIT_SECONDS = 10.0

_DTYPE_NAMES = {
    pb.DTYPE_F32: "fp32",
    pb.DTYPE_F16: "fp16",
    pb.DTYPE_BF16: "bf16",
    pb.DTYPE_F8_E4M3: "fp8_e4m3",
    pb.DTYPE_I64: "i64",
    pb.DTYPE_I32: "i32",
    pb.DTYPE_U8: "u8",
}
_PUSH_DTYPES = {"fp32": pb.DTYPE_F32, "fp16": pb.DTYPE_F16, "bf16": pb.DTYPE_BF16}
assert all(_tensors.PUSH_DTYPES[k] == v for k, v in _PUSH_DTYPES.items())
_NUMPY_DTYPES = {
    "fp32": np.float32,
    "fp16": np.float16,
    "bf16": np.uint16,  # numpy has no bfloat16: the raw bits
    "fp8_e4m3": np.uint8,  # the raw bits
    "i64": np.int64,
    "i32": np.int32,
    "u8": np.uint8,
}
_TORCH_DTYPES = {
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp8_e4m3": "float8_e4m3fn",
    "i64": "int64",
    "i32": "int32",
    "u8": "uint8",
}
_NON_FINITE = {
    "reject": pb.NON_FINITE_POLICY_REJECT,
    "vllm": pb.NON_FINITE_POLICY_VLLM_COMPATIBLE,
}
_LAYOUTS = {
    "kernel": pb.ListTensorsRequest.LAYOUT_KERNEL,
    "checkpoint": pb.ListTensorsRequest.LAYOUT_CHECKPOINT,
}


@dataclasses.dataclass(frozen=True)
class Tls:
    """TLS settings. With no CA file the system roots verify the daemon;
    cert_file + key_file present a client certificate (mutual TLS);
    server_name overrides the name checked in the daemon's certificate."""

    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    server_name: Optional[str] = None


def _varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative integer."""
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _read_file(path: str, what: str) -> bytes:
    try:
        return pathlib.Path(path).read_bytes()
    except PermissionError as e:
        raise error_for(grpc.StatusCode.PERMISSION_DENIED, f"cannot read {what} file {path}: {e}")
    except OSError as e:
        raise error_for(grpc.StatusCode.NOT_FOUND, f"cannot read {what} file {path}: {e}")


def _state_name(value: int) -> str:
    return pb.RefitState.Name(value).replace("REFIT_STATE_", "")


def _status(r: Any) -> Status:
    """A GetStatusResponse (or one of its groups) as a Status."""
    m, mem = r.model, r.memory
    return Status(
        model_group=r.model_group,
        version=r.version,
        fingerprint=r.fingerprint,
        device=r.device,
        ready=r.ready,
        active_refit=ActiveRefit(**_progress_fields(r.active_refit))
        if r.HasField("active_refit")
        else None,
        memory=MemoryUsage(
            mem.kernel_bytes,
            mem.staging_bytes,
            mem.peak_staging_bytes,
            mem.staging_budget_bytes,
            mem.resident_bytes,
        ),
        model=ModelSummary(
            m.architecture,
            m.num_layers,
            m.tp_rank,
            m.tp_size,
            m.quantization,
            m.checkpoint_dtype,
            m.num_kernel_tensors,
            m.kernel_bytes,
        ),
        last_commit_unix_seconds=r.last_commit_unix_seconds,
        server_version=r.server_version,
        engines=tuple(
            EngineInfo(
                engine_id=e.engine_id,
                pid=e.pid,
                uid=e.uid,
                coordinated=e.coordinated,
                attached_unix_seconds=e.attached_unix_seconds,
                version=e.version,
                name=e.name,
            )
            for e in r.engines
        ),
    )


def _result(msg: Any) -> RefitResult:
    t = msg.timings
    return RefitResult(
        refit_id=msg.refit_id,
        state=_state_name(msg.state),
        version=msg.version,
        fingerprint=msg.fingerprint,
        kept_layers=tuple(msg.kept_layers),
        partial_layers=tuple(msg.partial_layers),
        timings=PhaseTimings(
            t.receive_seconds, t.quantize_seconds, t.finalize_seconds, t.commit_seconds
        ),
        bytes_received=msg.bytes_received,
        peak_staging_bytes=msg.peak_staging_bytes,
        unchanged=msg.unchanged,
        bytes_read_in_place=msg.bytes_read_in_place,
        scales_reused=msg.scales_reused,
    )


def _progress_fields(p: Any) -> dict:
    return dict(
        refit_id=p.refit_id,
        state=_state_name(p.state),
        bytes_received=p.bytes_received,
        elements_loaded=p.elements_loaded,
        elements_expected=p.elements_expected,
        layers_done=p.layers_done,
        layers_total=p.layers_total,
        staging_bytes=p.staging_bytes,
    )


def _tensor_info(t: Any) -> TensorInfo:
    return TensorInfo(
        name=t.name,
        dtype=_DTYPE_NAMES.get(t.dtype, "unspecified"),
        shape=tuple(t.shape),
        nbytes=t.nbytes,
        layer=t.layer,
        optional=t.optional,
    )


def _options(
    prepare: bool,
    base_version: Optional[int],
    label: Optional[str],
    non_finite: str,
    allow_partial_layers: bool,
    require_complete: bool = False,
) -> Any:
    if non_finite not in _NON_FINITE:
        raise InvalidArgument(f"non_finite must be one of {sorted(_NON_FINITE)}, got {non_finite!r}")
    options = pb.RefitOptions(
        # Every enum is set explicitly: the daemon rejects X_UNSPECIFIED.
        completion=pb.COMPLETION_MODE_PREPARE if prepare else pb.COMPLETION_MODE_COMMIT,
        non_finite=_NON_FINITE[non_finite],
        allow_partial_layers=allow_partial_layers,
        require_complete=require_complete,
        label=label or "",
    )
    if base_version is not None:
        options.base_version = base_version
    return options


class _Pipe:
    """A bounded queue between the thread that sends and gRPC's thread that
    consumes the request iterator. put() blocks while the queue is full (the
    daemon sets the pace) and returns False once the call has ended."""

    def __init__(self, depth: int) -> None:
        self._cv = threading.Condition()
        self._items: Deque[Any] = collections.deque()
        self._depth = depth
        self._finished = False  # no more items: the iterator ends when drained
        self._closed = False  # the call ended: drop everything

    def put(self, item: Any) -> bool:
        with self._cv:
            while len(self._items) >= self._depth and not self._closed:
                self._cv.wait()
            if self._closed:
                return False
            self._items.append(item)
            self._cv.notify_all()
            return True

    def finish(self, drop_queued: bool = False) -> None:
        with self._cv:
            if drop_queued:
                self._items.clear()
            self._finished = True
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._items.clear()
            self._cv.notify_all()

    def __iter__(self) -> Iterator[Any]:
        while True:
            with self._cv:
                while not self._items and not self._finished and not self._closed:
                    self._cv.wait()
                if self._closed or not self._items:
                    return
                item = self._items.popleft()
                self._cv.notify_all()
            yield item


class _AggregateProgress:
    """One PushProgress over the streams of a push: each stream reports its
    own counts (stream(k)), the callback sees their sums."""

    def __init__(self, progress: Callable[[PushProgress], None], total: Optional[int]) -> None:
        self._progress = progress
        self._total = total
        self._start = time.monotonic()
        self._last: dict = {}

    def stream(self, k: int) -> Callable[[PushProgress], None]:
        def report(p: PushProgress) -> None:
            self._last[k] = p
            parts = self._last.values()
            self._progress(
                PushProgress(
                    bytes_sent=sum(q.bytes_sent for q in parts),
                    tensors_done=sum(q.tensors_done for q in parts),
                    messages_sent=sum(q.messages_sent for q in parts),
                    elapsed_seconds=time.monotonic() - self._start,
                    tensors_total=self._total,
                )
            )

        return report

    def close(self) -> None:
        close = getattr(self._progress, "close", None)
        if callable(close):
            close()


class Refit:
    """One refit transaction being streamed; made by RefitClient.refit().

    send() tensors one by one (any order, each at most once); leaving the
    ``with`` block normally sends End and waits for the daemon's answer
    (``result``). An exception inside the block abandons the refit: the
    daemon aborts it and the live version stays what it was. Not
    thread-safe: one thread sends.
    """

    def __init__(
        self,
        client: "RefitClient",
        begin: Any,
        *,
        chunk_bytes: int,
        bucket_bytes: int,
        checksums: bool,
        progress: Union[None, str, Callable[[PushProgress], None]],
        tensors_total: Optional[int],
        timeout: Optional[float],
    ) -> None:
        if chunk_bytes <= 0 or bucket_bytes <= 0:
            raise InvalidArgument("push: chunk_bytes and bucket_bytes must be positive")
        self._client = client
        self._chunk_bytes = chunk_bytes
        self._bucket_bytes = bucket_bytes
        self._checksums = checksums
        if progress == "tqdm":
            from ._progress import TqdmProgress

            progress = TqdmProgress()
        self._progress = progress
        self._tensors_total = tensors_total
        self._start = time.monotonic()
        self._bytes_sent = 0
        self._tensors_done = 0
        self._messages_sent = 0
        # The bucket being filled: wire bytes of Chunk messages (see _encode).
        self._parts: List[bytes] = []
        self._payload = 0
        self._bucket_fill = 0
        self._ended = False
        self.result: Optional[RefitResult] = None
        self._pipe = _Pipe(_QUEUE_DEPTH)
        self._pipe.put(pb.PushRequest(begin=begin).SerializeToString())
        self._call = client._push_bytes.future(
            iter(self._pipe), timeout=timeout, metadata=client._metadata
        )
        self._call.add_done_callback(lambda _: self._pipe.close())

    def __enter__(self) -> "Refit":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            self.finish()
        else:
            self.abandon()
        return False

    def _raise_call_error(self) -> None:
        """The call has ended early: raise why (the daemon's status)."""
        try:
            self._call.result()
        except grpc.RpcError as e:
            raise from_rpc_error(e, f"push to {self._client.address}") from None
        raise RefitError("push: the daemon answered before End")

    def _write(self, request: Any) -> None:
        if not self._pipe.put(request):
            self._raise_call_error()

    def _flush(self) -> None:
        if self._bucket_fill == 0 and not self._parts:
            return
        # PushRequest{chunks = 2: Chunks{chunks = 1: Chunk...}}.
        bucket = b"".join([b"\x12", _varint(self._payload), *self._parts])
        self._parts, self._payload = [], 0
        self._write(bucket)
        self._bytes_sent += self._bucket_fill
        self._bucket_fill = 0
        self._messages_sent += 1
        if self._progress is not None:
            self._progress(
                PushProgress(
                    bytes_sent=self._bytes_sent,
                    tensors_done=self._tensors_done,
                    messages_sent=self._messages_sent,
                    elapsed_seconds=time.monotonic() - self._start,
                    tensors_total=self._tensors_total,
                )
            )

    def send(self, name: str, tensor: Any, dtype: Any = None) -> None:
        """Streams one tensor: a torch tensor (CPU or CUDA, any strides; CUDA
        bytes are copied to the host one chunk at a time), a numpy array, or
        TensorData (e.g. bf16(array)). ``dtype`` ("bf16", "fp16", "fp32")
        converts a torch tensor, or names what a numpy array holds.

        Raises InvalidArgument for a tensor that cannot be sent (nothing of
        it is sent), or the daemon's error if it has already ended the refit.
        """
        if self._ended:
            raise InvalidArgument("push: send() after the refit ended")
        self._send_source(_tensors.to_source(name, tensor, dtype))

    def _send_source(self, src: _tensors.Source) -> None:
        item = src.itemsize
        cap = max(self._chunk_bytes // item, 1) * item
        dtype = _PUSH_DTYPES[src.dtype]
        name = src.name.encode()
        shape = b"".join(_varint(int(d)) for d in src.shape)
        # Chunk fields 1-3 (tensor_name, dtype, packed shape), the same for
        # every chunk of the tensor.
        head = b"\x0a" + _varint(len(name)) + name + b"\x10" + _varint(dtype)
        if shape:
            head += b"\x1a" + _varint(len(shape)) + shape
        offset = 0
        while True:
            room = max(self._bucket_bytes - self._bucket_fill, 0)
            if self._bucket_fill == 0:
                room = max(room, item)
            piece = min(src.nbytes - offset, cap, room)
            piece -= piece % item
            if piece == 0 and offset < src.nbytes:
                self._flush()  # not one element fits: send the bucket, start anew
                continue
            data = src.read(offset, piece)
            # Fields 4-6: byte_offset, data, xxh3.
            prefix = head + (b"\x20" + _varint(offset) if offset else b"")
            prefix += b"\x2a" + _varint(len(data))
            tail = b"\x30" + _varint(xxhash.xxh3_64_intdigest(data)) if self._checksums else b""
            size = len(prefix) + len(data) + len(tail)
            tag = b"\x0a" + _varint(size)
            self._parts += [tag, prefix, data, tail]
            self._payload += len(tag) + size
            offset += piece
            self._bucket_fill += piece
            if self._bucket_fill >= self._bucket_bytes:
                self._flush()
            # A zero-sized tensor still sends one (empty) chunk.
            if offset >= src.nbytes:
                break
        self._tensors_done += 1

    def _send_region(
        self,
        src: _tensors.Source,
        lease: "_shm.Lease",
        base: int,
        cache: Optional[Dict[Any, List[Tuple[bytes, int]]]] = None,
    ) -> None:
        """Streams one tensor as chunks that reference `lease`'s region from
        byte `base` (the shared-memory lane): Chunk.region instead of data,
        no checksum (the bytes do not travel). The bucket counts the bytes
        referenced. With `cache`, the encoded chunks are kept there under
        everything they are made of, for the next push of the same tensor
        at the same place (a training loop's): encoding them was about a
        sixth of the client's CPU in such a push."""
        item = src.itemsize
        cap = max(self._chunk_bytes // item, 1) * item
        key = (src.name, src.dtype, tuple(src.shape), src.nbytes, lease.region_id_bytes, base, cap)
        chunks = cache.get(key) if cache is not None else None
        if chunks is None:
            chunks = self._region_chunks(src, lease.region_id_bytes, base, cap)
            if cache is not None:
                if len(cache) >= _REGION_CHUNK_CACHE:
                    cache.clear()
                cache[key] = chunks
        for message, piece in chunks:
            self._parts.append(message)
            self._payload += len(message)
            self._bucket_fill += piece
            if self._bucket_fill >= self._bucket_bytes or len(self._parts) >= _MAX_REGION_CHUNKS:
                self._flush()
        self._tensors_done += 1

    @staticmethod
    def _region_chunks(
        src: _tensors.Source, region_id: bytes, base: int, cap: int
    ) -> List[Tuple[bytes, int]]:
        """The wire bytes of `src`'s chunks referencing region `region_id`
        from byte `base`, `cap` bytes each at most, with the bytes each
        references. A zero-sized tensor still has one (empty) chunk."""
        dtype = _PUSH_DTYPES[src.dtype]
        name = src.name.encode()
        shape = b"".join(_varint(int(d)) for d in src.shape)
        head = b"\x0a" + _varint(len(name)) + name + b"\x10" + _varint(dtype)
        if shape:
            head += b"\x1a" + _varint(len(shape)) + shape
        # RegionRef{region_id = 1, offset = 2, length = 3}.
        rid = b"\x0a" + _varint(len(region_id)) + region_id
        chunks: List[Tuple[bytes, int]] = []
        offset = 0
        while True:
            piece = min(src.nbytes - offset, cap)
            ref = rid + b"\x10" + _varint(base + offset) + b"\x18" + _varint(piece)
            body = head + (b"\x20" + _varint(offset) if offset else b"")
            body += b"\x3a" + _varint(len(ref)) + ref  # Chunk.region = 7
            chunks.append((b"\x0a" + _varint(len(body)) + body, piece))
            offset += piece
            if offset >= src.nbytes:
                return chunks

    def finish(self) -> RefitResult:
        """Sends End and returns the daemon's result (the with block calls it)."""
        if self.result is not None:
            return self.result
        self._send_end()
        return self._await_result()

    def _send_end(self, allow_empty: bool = False) -> None:
        """Flushes the bucket and sends End, without waiting for the answer
        (a stream of a refit over several streams is answered only once every
        stream has ended)."""
        if self._ended:
            raise InvalidArgument("push: the refit was abandoned")
        self._ended = True
        try:
            if self._tensors_done == 0 and not allow_empty:
                raise InvalidArgument("push: no tensors")
            self._flush()
            self._write(pb.PushRequest(end=pb.End()).SerializeToString())
        except BaseException:
            self._abandon_call()
            raise
        self._pipe.finish()
        self._close_progress()

    def _await_result(self) -> RefitResult:
        try:
            response = self._call.result()
        except grpc.RpcError as e:
            raise from_rpc_error(e, f"push to {self._client.address}") from None
        self.result = _result(response.result)
        return self.result

    def _close_progress(self) -> None:
        close = getattr(self._progress, "close", None)
        if callable(close):
            close()

    def abandon(self) -> None:
        """Ends the stream without End: the daemon aborts the refit. Waits
        (briefly) for its answer, so the model group is free again on return."""
        if self._ended and self._call.done():
            return
        self._ended = True
        self._close_progress()
        self._abandon_call()

    def _abandon_call(self) -> None:
        # Half-closing without End makes the daemon abort the refit and answer
        # ABORTED once the group is free; cancel only if that answer is slow.
        self._pipe.finish(drop_queued=True)
        try:
            self._call.exception(timeout=_ABANDON_WAIT_SECONDS)
        except grpc.FutureTimeoutError:
            self._call.cancel()
        except grpc.FutureCancelledError:
            pass


class EventStream:
    """Iterator of WatchEvent (the first is a snapshot of the current state).
    cancel() (or leaving a ``with`` block) ends it; iteration then stops."""

    def __init__(self, call: Any, address: str) -> None:
        self._call = call
        self._address = address
        self._cancelled = False

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> WatchEvent:
        try:
            e = next(self._call)
        except grpc.RpcError as err:
            if self._cancelled and err.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise from_rpc_error(err, f"watch on {self._address}") from None
        return WatchEvent(
            type=pb.WatchEvent.Type.Name(e.type).replace("TYPE_", ""),
            model_group=e.model_group,
            refit_id=e.refit_id,
            version=e.version,
            fingerprint=e.fingerprint,
            message=e.message,
            unix_seconds=e.unix_seconds,
        )

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cancel()


class _ShmRefused(Exception):
    """The daemon refused a shared-memory region (before any refit began)."""

    def __init__(self, error: RefitError) -> None:
        super().__init__(str(error))
        self.error = error


# sockaddr_un.sun_path holds 108 bytes with its terminating NUL.
_MAX_UNIX_PATH = 107


class RefitClient:
    """Client of one refitd daemon.

    ``address`` is "host:port" or "unix:/path" (as refitctl's --addr).
    ``token`` (or the first line of ``token_file``) is sent as a bearer token
    on every call but health. ``tls`` is a Tls (or True: TLS with the system
    roots). ``timeout`` is the deadline, in seconds, of each read-only and
    unary call (status, tensors, read, health, commit, abort); pushes and
    reloads have none unless given one per call. ``shm_staging_limit``: the
    most bytes push(lane="auto") copies into the shared-memory lane's staging
    region (a larger push goes over gRPC, streamed with bounded memory).
    ``cuda_ipc`` (default True): the shared-memory lane hands CUDA tensors
    to the daemon by CUDA IPC handle (it reads them device to device) instead
    of copying them into host staging; ``cuda_ipc_fallback_reason`` says why
    it last could not.

    Read-only calls wait for the daemon to be reachable (wait_for_ready) up
    to their deadline, so they ride out a daemon restart; an unreachable
    daemon is Unavailable when the deadline passes. A push is never retried:
    if its answer is lost the refit may still have committed (check
    status(), or push with base_version).

    The channel connects lazily: constructing a client never fails on an
    unreachable daemon. Thread-safe; use as a context manager or call
    close().
    """

    def __init__(
        self,
        address: str,
        token: Optional[str] = None,
        token_file: Optional[str] = None,
        tls: Union[Tls, bool, None] = None,
        *,
        timeout: Optional[float] = DEFAULT_TIMEOUT,
        shm_staging_limit: int = DEFAULT_SHM_STAGING_LIMIT,
        cuda_ipc: bool = True,
    ) -> None:
        if not address:
            raise InvalidArgument("empty daemon address")
        if address.startswith("unix:"):
            path = address[len("unix:"):]
            path = path[2:] if path.startswith("//") else path
            if len(path.encode()) > _MAX_UNIX_PATH:
                raise InvalidArgument(
                    f'address "{address}": its socket path is {len(path.encode())} bytes; a Unix '
                    f"socket path holds at most {_MAX_UNIX_PATH} (connect from its directory with "
                    "a relative unix: path)")
        if token is not None and token_file is not None:
            raise InvalidArgument("give token or token_file, not both")
        if token_file is not None:
            lines = _read_file(token_file, "token").decode().splitlines()
            token = lines[0].strip() if lines else ""
        self.address = address
        self.timeout = timeout
        self._metadata: Tuple[Tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        options: List[Tuple[str, Any]] = [
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            # Fail fast on a dead daemon, and find a restarted one quickly.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if tls:
            t = tls if isinstance(tls, Tls) else Tls()
            if (t.cert_file is None) != (t.key_file is None):
                raise InvalidArgument("a client certificate needs both cert_file and key_file")
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read_file(t.ca_file, "TLS CA") if t.ca_file else None,
                private_key=_read_file(t.key_file, "TLS key") if t.key_file else None,
                certificate_chain=_read_file(t.cert_file, "TLS certificate")
                if t.cert_file
                else None,
            )
            if t.server_name:
                options.append(("grpc.ssl_target_name_override", t.server_name))
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.RefitServiceStub(self._channel)
        # The shared-memory lane (_shm.py): on a Unix socket by default.
        self._shm: Optional[_shm.ShmLane] = None
        self._shm_lock = threading.Lock()
        self._shm_auto = address.startswith("unix:")
        self._shm_staging_limit = shm_staging_limit
        self._cuda_ipc = cuda_ipc
        # Why push(lane="auto") last fell back to gRPC, or None.
        self.shm_fallback_reason: Optional[str] = None
        # Push with requests encoded by Refit itself: building a PushRequest
        # and serializing it copies every tensor byte twice more, and the
        # protobuf runtime's cost per byte grows with the message (measured in
        # bench/python/push_bench.py); the wire bytes are the same.
        self._push_bytes = self._channel.stream_unary(
            "/refit.v1.RefitService/Push",
            request_serializer=None,
            response_deserializer=pb.PushResponse.FromString,
        )
        self._health_check = self._channel.unary_unary(
            _health.CHECK_METHOD,
            request_serializer=_health.encode_request,
            response_deserializer=_health.decode_response,
        )
        self._health_watch = self._channel.unary_stream(
            _health.WATCH_METHOD,
            request_serializer=_health.encode_request,
            response_deserializer=_health.decode_response,
        )

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled, and the
        shared-memory regions this client registered are released."""
        with self._shm_lock:
            if self._shm is not None:
                self._shm.close()
                self._shm = None
        self._channel.close()

    def __enter__(self) -> "RefitClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------

    def _deadline(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    def _read_error(self, e: grpc.RpcError, what: str, timeout: Optional[float]) -> RefitError:
        """A read-only call's error. Such calls wait for the daemon to become
        reachable, so an unreachable one ends in DEADLINE_EXCEEDED; a probe
        that does not wait tells that apart, and the caller gets Unavailable
        with the connection error, which is what it acts on."""
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            try:
                self._health_check(_health.LIVENESS_SERVICE, timeout=1.0, wait_for_ready=False)
            except grpc.RpcError as probe:
                if probe.code() == grpc.StatusCode.UNAVAILABLE:
                    return Unavailable(
                        f"{what}: refitd at {self.address} unreachable within {timeout}s: "
                        f"{probe.details()}"
                    )
        return from_rpc_error(e, f"{what} from {self.address}")

    def _unary_read(self, method: Any, request: Any, what: str, timeout: Optional[float]) -> Any:
        deadline = self._deadline(timeout)
        try:
            return method(
                request, timeout=deadline, metadata=self._metadata, wait_for_ready=True
            )
        except grpc.RpcError as e:
            raise self._read_error(e, what, deadline) from None

    # -- refits ----------------------------------------------------------------

    def refit(
        self,
        *,
        prepare: bool = False,
        base_version: Optional[int] = None,
        label: Optional[str] = None,
        group: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        checksums: bool = True,
        non_finite: str = "reject",
        allow_partial_layers: bool = False,
        require_complete: bool = True,
        progress: Union[None, str, Callable[[PushProgress], None]] = None,
        timeout: Optional[float] = None,
        _tensors_total: Optional[int] = None,
        _refit_id: str = "",
    ) -> Refit:
        """Starts one refit to stream tensor by tensor::

            with client.refit(label="step 7") as r:
                for name, t in model.state_dict().items():
                    r.send(name, t)
            print(r.result.version)

        An exception inside the block abandons the refit (the daemon aborts
        it; the live version is unchanged) and propagates. Options as push().
        """
        begin = pb.Begin(
            model_group=group,
            options=_options(
                prepare, base_version, label, non_finite, allow_partial_layers, require_complete
            ),
            refit_id=_refit_id,
        )
        return Refit(
            self,
            begin,
            chunk_bytes=chunk_bytes,
            bucket_bytes=bucket_bytes,
            checksums=checksums,
            progress=progress,
            tensors_total=_tensors_total,
            timeout=timeout,
        )

    def push(
        self,
        tensors: _tensors.TensorsArg,
        *,
        prepare: bool = False,
        base_version: Optional[int] = None,
        label: Optional[str] = None,
        group: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        checksums: bool = True,
        non_finite: str = "reject",
        allow_partial_layers: bool = False,
        require_complete: bool = True,
        progress: Union[None, str, Callable[[PushProgress], None]] = None,
        timeout: Optional[float] = None,
        streams: int = 1,
        refit_id: str = "",
        lane: str = "auto",
    ) -> RefitResult:
        """Pushes tensors as one refit transaction and returns its result.

        ``tensors``: a mapping name -> tensor (a state_dict) or an iterable
        of (name, tensor) or (name, tensor, dtype); read lazily, so a
        generator streams a model without holding it. Tensors: torch (CPU or
        CUDA, any strides), numpy float32/float16, bf16 bits as
        (name, uint16_array, "bf16") or bf16(array).

        ``prepare``: stop at PREPARED (result.state), then commit() or
        abort(). ``base_version``: refuse unless the live version is this
        (StaleBaseVersion). ``chunk_bytes``: largest chunk of one tensor;
        ``bucket_bytes``: tensor bytes per gRPC message (on the shared-memory
        lane: bytes referenced, 64 MiB by default). Every chunk carries
        its XXH3-64 unless ``checksums=False``. ``non_finite``: "reject" or
        "vllm". ``require_complete`` (default True): the daemon refuses
        (FailedPrecondition, naming what is missing) a refit that leaves any
        checkpoint tensor out, which would serve new weights next to old
        ones; pass False for a deliberate partial refit. A push with no
        tensors at all is refused here (InvalidArgument).
        ``progress`` is called with a PushProgress after every
        message; ``progress="tqdm"`` draws a tqdm bar instead (TqdmProgress,
        needs tqdm). ``timeout``: deadline of the whole push (none by default).
        ``streams``: how many concurrent Push streams carry the refit (the
        tensors are split among them by tensor, balanced by bytes; the daemon
        commits once every stream has ended; any stream failing aborts the
        whole refit). ``refit_id``: the refit's id (1 to 64 of
        [A-Za-z0-9._-]; AlreadyExists if in use); with streams > 1 one is
        made up when empty.

        ``lane``: "shm" sends chunks that reference the tensors in shared
        memory instead of carrying their bytes (the daemon reads them in
        place; needs the daemon's Unix socket): CPU tensors already in shared
        memory (``share_memory_()``) go with no copy, CUDA tensors by their
        allocation's CUDA IPC handle (the daemon copies them device to
        device; the client synchronizes their devices first), the others are
        copied once into the client's staging region; checksums do not
        apply.
        "grpc" carries the bytes in the messages. "auto" (the default) is
        "shm" on a ``unix:`` address with one stream unless the tensors to
        copy exceed the client's ``shm_staging_limit`` (default 4 GiB), and
        falls back to "grpc" when the daemon refuses the region
        (``shm_fallback_reason`` says why); "grpc" otherwise.

        Never retried. Raises: InvalidArgument (a tensor this client cannot
        send, or one the daemon refuses), RefitConflict (another refit is
        active), StaleBaseVersion, NotFound (unknown tensor or group),
        ChecksumMismatch (DATA_LOSS), FailedPrecondition (a layer missing
        tensors), ResourceExhausted, PermissionDenied, DeadlineExceeded,
        Unavailable (unreachable, or the answer was lost: check status()).
        """
        if streams < 1:
            raise InvalidArgument(f"push: streams must be at least 1, got {streams}")
        if lane not in _LANES:
            raise InvalidArgument(f"push: lane must be one of {', '.join(_LANES)}, got {lane!r}")
        if lane == "shm" and streams > 1:
            raise InvalidArgument("push: lane='shm' carries a refit over one stream")
        if lane == "shm" or (lane == "auto" and self._shm_auto and streams == 1):
            if lane == "auto" and not isinstance(tensors, (Mapping, list, tuple)):
                # An iterator (named_parameters()): the lane reads it to
                # plan, and a fallback to gRPC reads the same pairs again.
                tensors = list(tensors)
            try:
                return self._push_shm(
                    tensors,
                    prepare=prepare,
                    base_version=base_version,
                    label=label,
                    group=group,
                    chunk_bytes=_SHM_CHUNK_BYTES if chunk_bytes == DEFAULT_CHUNK_BYTES else chunk_bytes,
                    bucket_bytes=(
                        _SHM_BUCKET_BYTES if bucket_bytes == DEFAULT_BUCKET_BYTES else bucket_bytes
                    ),
                    non_finite=non_finite,
                    allow_partial_layers=allow_partial_layers,
                    require_complete=require_complete,
                    progress=progress,
                    timeout=timeout,
                    refit_id=refit_id,
                    explicit=lane == "shm",
                )
            except _ShmRefused as refused:
                if lane == "shm":
                    raise refused.error from None
                self.shm_fallback_reason = str(refused.error)
                if refused.error.code in (
                    grpc.StatusCode.UNIMPLEMENTED,
                    grpc.StatusCode.FAILED_PRECONDITION,
                ):
                    self._shm_auto = False  # this daemon has no lane for us
        if streams > 1:
            return self._push_streams(
                tensors,
                streams,
                refit_id or f"push-{secrets.token_hex(8)}",
                begin_options=_options(
                    prepare, base_version, label, non_finite, allow_partial_layers, require_complete
                ),
                group=group,
                chunk_bytes=chunk_bytes,
                bucket_bytes=bucket_bytes,
                checksums=checksums,
                progress=progress,
                timeout=timeout,
            )
        r = self.refit(
            prepare=prepare,
            base_version=base_version,
            label=label,
            group=group,
            chunk_bytes=chunk_bytes,
            bucket_bytes=bucket_bytes,
            checksums=checksums,
            non_finite=non_finite,
            allow_partial_layers=allow_partial_layers,
            require_complete=require_complete,
            progress=progress,
            timeout=timeout,
            _tensors_total=_tensors.count(tensors),
            _refit_id=refit_id,
        )
        with r:
            for src in _tensors.iter_sources(tensors):
                r._send_source(src)
        assert r.result is not None
        return r.result

    @property
    def cuda_ipc_fallback_reason(self) -> Optional[str]:
        """Why the shared-memory lane last copied CUDA tensors into host
        staging instead of handing them by CUDA IPC handle, or None."""
        return self._shm.cuda_ipc_fallback_reason if self._shm is not None else None

    def _shm_lane(self) -> _shm.ShmLane:
        with self._shm_lock:
            if self._shm is None:
                self._shm = _shm.ShmLane(
                    self._channel, self._metadata, self.address, cuda_ipc=self._cuda_ipc
                )
            return self._shm

    def _push_shm(
        self,
        tensors: _tensors.TensorsArg,
        *,
        prepare: bool,
        base_version: Optional[int],
        label: Optional[str],
        group: str,
        chunk_bytes: int,
        bucket_bytes: int,
        non_finite: str,
        allow_partial_layers: bool,
        require_complete: bool,
        progress: Union[None, str, Callable[[PushProgress], None]],
        timeout: Optional[float],
        refit_id: str,
        explicit: bool,
    ) -> RefitResult:
        """push() over the shared-memory lane: the regions first (a refusal
        there is _ShmRefused, before any refit began), then one Push whose
        chunks reference them; a tensor to be copied is copied just before
        its chunks are sent, so the daemon ingests while the next is copied."""
        sources = list(_tensors.iter_sources(tensors))
        if not sources:
            raise InvalidArgument("push: no tensors")
        lane = self._shm_lane()
        with lane.lock:
            try:
                try:
                    plan = lane.plan(sources, None if explicit else self._shm_staging_limit)
                except RefitError as e:
                    raise _ShmRefused(e) from None
                r = self.refit(
                    prepare=prepare,
                    base_version=base_version,
                    label=label,
                    group=group,
                    chunk_bytes=chunk_bytes,
                    bucket_bytes=bucket_bytes,
                    checksums=False,
                    non_finite=non_finite,
                    allow_partial_layers=allow_partial_layers,
                    require_complete=require_complete,
                    progress=progress,
                    timeout=timeout,
                    _tensors_total=len(sources),
                    _refit_id=refit_id,
                )
                copied = 0
                try:
                    with r:
                        for src, lease, offset, copy in plan:
                            if copy:
                                # What is queued goes first: the daemon
                                # ingests it while this tensor is copied.
                                r._flush()
                                lane.copy(src, offset)
                                copied += src.nbytes
                            r._send_region(src, lease, offset, lane.chunk_cache)
                except RefitError as e:
                    lane.drop_truncated(e.message)
                    raise
            finally:
                # The push's CUDA allocations: released once it has ended.
                lane.end_push()
            lane.last_copied_bytes = copied
        assert r.result is not None
        return r.result

    def _push_streams(
        self,
        tensors: _tensors.TensorsArg,
        streams: int,
        refit_id: str,
        *,
        begin_options: Any,
        group: str,
        chunk_bytes: int,
        bucket_bytes: int,
        checksums: bool,
        progress: Union[None, str, Callable[[PushProgress], None]],
        timeout: Optional[float],
    ) -> RefitResult:
        """push() over several streams: the first opens the refit, the others
        join it once the daemon has accepted the first one's Begin (its
        initial metadata names the refit). One thread sends: each tensor goes
        to the stream with the fewest bytes so far."""
        if progress == "tqdm":
            from ._progress import TqdmProgress

            progress = TqdmProgress()
        total = _tensors.count(tensors)
        aggregate = _AggregateProgress(progress, total) if progress is not None else None
        kwargs = dict(
            chunk_bytes=chunk_bytes,
            bucket_bytes=bucket_bytes,
            checksums=checksums,
            tensors_total=total,
            timeout=timeout,
        )
        opener = Refit(
            self,
            pb.Begin(model_group=group, options=begin_options, streams=streams, refit_id=refit_id),
            progress=aggregate.stream(0) if aggregate else None,
            **kwargs,
        )
        refits = [opener]
        try:
            metadata = dict(opener._call.initial_metadata() or ())
            if "refit-id" not in metadata:
                opener._raise_call_error()  # refused: the daemon's reason
            for k in range(1, streams):
                refits.append(
                    Refit(
                        self,
                        pb.Begin(join_refit_id=refit_id),
                        progress=aggregate.stream(k) if aggregate else None,
                        **kwargs,
                    )
                )
            sent = [0] * streams
            for src in _tensors.iter_sources(tensors):
                k = sent.index(min(sent))
                refits[k]._send_source(src)
                sent[k] += src.nbytes
            if sum(r._tensors_done for r in refits) == 0:
                raise InvalidArgument("push: no tensors")
            for r in refits:
                r._send_end(allow_empty=True)
        except BaseException:
            for r in refits:
                r.abandon()
            if aggregate is not None:
                aggregate.close()
            raise
        if aggregate is not None:
            aggregate.close()
        errors: List[RefitError] = []
        for r in refits:
            try:
                r._await_result()
            except RefitError as e:
                errors.append(e)
        if errors:
            # The cause, rather than the ABORTED of the streams it took down.
            causes = [e for e in errors if e.code != grpc.StatusCode.ABORTED]
            raise (causes or errors)[0]
        assert opener.result is not None
        return opener.result

    def reload(
        self,
        path: str,
        progress: Optional[Callable[[ReloadProgress], None]] = None,
        *,
        prepare: bool = False,
        base_version: Optional[int] = None,
        label: Optional[str] = None,
        group: str = "",
        non_finite: str = "reject",
        allow_partial_layers: bool = False,
        require_complete: bool = True,
        timeout: Optional[float] = None,
    ) -> RefitResult:
        """The daemon reloads safetensors from ``path`` (a directory or file
        under its --reload-root) as one refit; ``progress`` gets a
        ReloadProgress after every tensor. Never retried.
        Raises PermissionDenied (outside the root, no root, not operator),
        NotFound, InvalidArgument, and push()'s errors."""
        request = pb.ReloadRequest(
            model_group=group,
            path=path,
            options=_options(
                prepare, base_version, label, non_finite, allow_partial_layers, require_complete
            ),
        )
        result = None
        try:
            for message in self._stub.Reload(request, timeout=timeout, metadata=self._metadata):
                if message.HasField("progress"):
                    if progress is not None:
                        progress(ReloadProgress(**_progress_fields(message.progress)))
                elif message.HasField("result"):
                    result = _result(message.result)
        except grpc.RpcError as e:
            raise from_rpc_error(e, f"reload on {self.address}") from None
        if result is None:
            raise error_for(grpc.StatusCode.DATA_LOSS, "reload: the stream ended without a result")
        return result

    def commit(
        self,
        refit_id: str,
        *,
        group: str = "",
        linked: Optional[Sequence[Tuple[str, str]]] = None,
        timeout: Optional[float] = None,
    ) -> RefitResult:
        """Commits a refit pushed with prepare=True. Never retried.
        ``linked``: (group, refit_id) pairs of PREPARED refits of other groups
        committed with this one at one commit point, all or none (their
        results: commit_linked). Raises NotFound (unknown refit or group),
        FailedPrecondition (still receiving), PermissionDenied (another
        trainer's refit), InvalidArgument (a group named twice), Unavailable;
        a refused linked commit leaves every refit as it was."""
        return self.commit_linked([(group, refit_id)] + list(linked or ()), timeout=timeout)[0]

    def commit_linked(
        self, refits: Sequence[Tuple[str, str]], *, timeout: Optional[float] = None
    ) -> List[RefitResult]:
        """Commits the PREPARED refits ``refits`` ((group, refit_id) pairs, one
        per group; "" is the default group, or the caller's active refit) at
        one commit point: readers see all their groups' old versions or all
        the new ones. Results in the order given. Errors as commit()."""
        if not refits:
            raise InvalidArgument("commit_linked: no refits")
        (group, refit_id), rest = refits[0], refits[1:]
        request = pb.CommitRequest(model_group=group, refit_id=refit_id)
        for g, r in rest:
            request.linked.add(model_group=g, refit_id=r)
        try:
            response = self._stub.Commit(
                request, timeout=self._deadline(timeout), metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e, f"commit on {self.address}") from None
        return [_result(response.result)] + [_result(r) for r in response.linked]

    def push_linked(
        self,
        tensors_by_group: Mapping[str, Any],
        *,
        label: str = "",
        timeout: Optional[float] = None,
        **push_kwargs: Any,
    ) -> Dict[str, RefitResult]:
        """Pushes each group's tensors (a target and its draft, say) as a
        PREPARED refit, then commits them all at one commit point. Any
        failure (a bad tensor for one group, a refused commit) aborts the
        refits already prepared and raises that error: no group changes
        unless all do. Returns the committed results by group."""
        prepared: List[Tuple[str, str]] = []
        try:
            for group, tensors in tensors_by_group.items():
                r = self.push(
                    tensors, prepare=True, label=label, group=group, timeout=timeout, **push_kwargs
                )
                prepared.append((group, r.refit_id))
            results = self.commit_linked(prepared, timeout=timeout)
        except BaseException as e:
            aborted = []
            for group, refit_id in prepared:
                try:
                    self.abort(refit_id, "linked push failed", group=group, timeout=timeout)
                    aborted.append(f"{group or '(default)'}: {refit_id}")
                except RefitError:
                    pass  # already gone (aborted by a failed commit, or expired)
            if aborted and isinstance(e, RefitError):
                # The daemon's message may say the refits stay PREPARED (a
                # commit the engines did not quiesce for): not after this.
                e.message += f" [push_linked aborted the refits it prepared: {', '.join(aborted)}]"
                e.args = (f"{e.code.name}: {e.message}",)
            raise
        return {group: result for (group, _), result in zip(prepared, results)}

    def abort(
        self, refit_id: str = "", reason: str = "", *, group: str = "", timeout: Optional[float] = None
    ) -> AbortResult:
        """Aborts a prepared or running refit; an empty refit_id means what
        AbortRequest.refit_id "" means to the daemon (see the proto). A
        prepared refit whose commit waits for attached engines is aborted
        too (that commit raises RefitConflict). Raises NotFound,
        PermissionDenied, Unavailable; FailedPrecondition if the refit's
        commit had begun copying (it is committed)."""
        try:
            response = self._stub.Abort(
                pb.AbortRequest(model_group=group, refit_id=refit_id, reason=reason),
                timeout=self._deadline(timeout),
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e, f"abort on {self.address}") from None
        return AbortResult(refit_id=response.refit_id, version=response.version)

    # -- read-only ---------------------------------------------------------------

    def status(self, *, group: str = "", timeout: Optional[float] = None) -> Status:
        """The served version, fingerprint, active refit, memory, model and
        attached engines."""
        r = self._unary_read(
            self._stub.GetStatus, pb.GetStatusRequest(model_group=group), "status", timeout
        )
        return _status(r)

    def statuses(self, *, timeout: Optional[float] = None) -> List[Status]:
        """status() of every model group the daemon serves, the default group
        first, all as of one instant (a linked commit shows in all its groups
        or in none)."""
        r = self._unary_read(
            self._stub.GetStatus, pb.GetStatusRequest(all_groups=True), "status", timeout
        )
        return [_status(g) for g in r.groups]

    def tensors(
        self, layout: str = "kernel", *, group: str = "", timeout: Optional[float] = None
    ) -> List[TensorInfo]:
        """The kernel tensors the daemon serves (layout="kernel") or the
        checkpoint tensors a trainer pushes (layout="checkpoint")."""
        if layout not in _LAYOUTS:
            raise InvalidArgument(f"layout must be 'kernel' or 'checkpoint', got {layout!r}")
        r = self._unary_read(
            self._stub.ListTensors,
            pb.ListTensorsRequest(model_group=group, layout=_LAYOUTS[layout]),
            "tensors",
            timeout,
        )
        return [_tensor_info(t) for t in r.tensors]

    def read_raw(
        self,
        name: str,
        *,
        group: str = "",
        version: Optional[int] = None,
        fingerprint: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> Tuple[TensorInfo, int, bytes]:
        """A live kernel tensor's bytes, all of one version:
        (info, version, data). `version` pins the read to that version: it
        raises RefitConflict (ABORTED, naming both versions) unless that
        version is live for the whole read, so reads of several tensors
        pinned to one version never mix versions (one spanning a commit
        fails instead). `fingerprint` (status().fingerprint) pins the content
        as well: a daemon restarted without --state-dir counts versions from
        1 again, with other weights. An unpinned read that a commit cuts is
        read again (up to READ_ATTEMPTS times in all). Raises NotFound
        (unknown tensor) and ChecksumMismatch (DATA_LOSS) when the stream is
        inconsistent."""
        deadline = self._deadline(timeout)
        request = pb.ReadTensorRequest(model_group=group, name=name)
        if version is not None:
            request.version = version
        if fingerprint is not None:
            request.fingerprint = fingerprint
        pinned = version is not None or fingerprint is not None
        # One deadline for every attempt.
        end = None if deadline is None else time.monotonic() + deadline

        def read_once() -> Tuple[TensorInfo, int, bytes]:
            left = None if end is None else max(0.0, end - time.monotonic())
            return self._read_once(request, left)

        for _ in range(0 if pinned else self.READ_ATTEMPTS - 1):
            try:
                return read_once()
            except RefitConflict:
                pass  # a commit cut it: read again
        return read_once()

    # Reads of an unpinned tensor that commits kept cutting, in all.
    READ_ATTEMPTS = 4

    def _read_once(
        self, request: "pb.ReadTensorRequest", deadline: Optional[float]
    ) -> Tuple[TensorInfo, int, bytes]:
        name = request.name
        info = None
        version = 0
        served = ""  # the version's fingerprint, from the first message
        parts: List[bytes] = []
        size = 0
        try:
            for m in self._stub.ReadTensor(
                request, timeout=deadline, metadata=self._metadata, wait_for_ready=True
            ):
                if info is None:
                    info, version, served = m.info, m.version, m.fingerprint
                elif m.version != version:
                    raise error_for(
                        grpc.StatusCode.DATA_LOSS,
                        f"read {name}: stream mixes versions {version} and {m.version}",
                    )
                if m.byte_offset != size:
                    raise error_for(
                        grpc.StatusCode.DATA_LOSS,
                        f"read {name}: piece at offset {m.byte_offset}, expected {size}",
                    )
                parts.append(m.data)
                size += len(m.data)
        except grpc.RpcError as e:
            raise self._read_error(e, f"read {name}", deadline) from None
        if info is None:
            raise error_for(grpc.StatusCode.DATA_LOSS, f"read {name}: empty stream")
        if size != info.nbytes:
            raise error_for(
                grpc.StatusCode.DATA_LOSS, f"read {name}: got {size} bytes, expected {info.nbytes}"
            )
        # The daemon checks the pin; this catches one that does not know it
        # (it would serve whatever is live).
        if request.HasField("fingerprint") and served != request.fingerprint:
            if not served:
                raise error_for(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"read {name}: the daemon does not answer fingerprint pins (an older refitd)",
                )
            raise error_for(
                grpc.StatusCode.ABORTED,
                f"read {name}: pinned to fingerprint {request.fingerprint} but version {version} "
                f"has fingerprint {served}",
            )
        return _tensor_info(info), version, b"".join(parts)

    def read(
        self,
        name: str,
        as_: str = "numpy",
        *,
        group: str = "",
        version: Optional[int] = None,
        fingerprint: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        """A live kernel tensor, shaped: as a numpy array (bf16 and FP8 as
        their raw bits, uint16 / uint8) or, with as_="torch", a torch tensor
        (FP8 as torch.float8_e4m3fn, bf16 as torch.bfloat16). `version` pins
        the read as in read_raw() (RefitConflict unless it is live), and so
        does `fingerprint`."""
        if as_ not in ("numpy", "torch"):
            raise InvalidArgument(f"as_ must be 'numpy' or 'torch', got {as_!r}")
        info, _, data = self.read_raw(
            name, group=group, version=version, fingerprint=fingerprint, timeout=timeout
        )
        if as_ == "torch":
            import torch

            dtype = getattr(torch, _TORCH_DTYPES[info.dtype])
            if not data:
                return torch.empty(info.shape, dtype=dtype)
            return torch.frombuffer(bytearray(data), dtype=dtype).reshape(info.shape)
        return np.frombuffer(data, dtype=_NUMPY_DTYPES[info.dtype]).reshape(info.shape)

    def watch(self, *, group: str = "") -> EventStream:
        """Refit events until cancelled; the first is a SNAPSHOT. No deadline."""
        call = self._stub.Watch(pb.WatchRequest(model_group=group), metadata=self._metadata)
        return EventStream(call, self.address)

    def health(self, *, group: str = "", timeout: Optional[float] = None) -> Health:
        """grpc.health.v1 Check of "" (live) and refit.v1.RefitService (ready:
        every model group loaded; with ``group``, that group's
        "refit.v1.RefitService/GROUP"). Sends no token. Raises Unavailable
        when unreachable by the deadline."""
        deadline = self._deadline(timeout)
        out = []
        readiness = _health.READINESS_SERVICE + (f"/{group}" if group else "")
        for service in (_health.LIVENESS_SERVICE, readiness):
            try:
                out.append(self._health_check(service, timeout=deadline, wait_for_ready=True))
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    out.append("SERVICE_UNKNOWN")
                else:
                    raise self._read_error(e, "health", deadline) from None
        return Health(live=out[0], ready=out[1])

    def wait_until_ready(self, timeout: float = 60.0) -> Health:
        """Blocks until the daemon is reachable and ready (version 1 loaded),
        following its readiness with a health Watch; rides out a daemon that
        is still starting or restarting. Raises DeadlineExceeded when it is
        not ready within ``timeout`` seconds."""
        end = time.monotonic() + timeout
        last = "UNKNOWN"
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                break
            call = self._health_watch(
                _health.READINESS_SERVICE, timeout=remaining, wait_for_ready=True
            )
            try:
                for status in call:
                    last = status
                    if status == "SERVING":
                        call.cancel()
                        return Health(live="SERVING", ready="SERVING")
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    break
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise from_rpc_error(e, f"health watch on {self.address}") from None
                # UNAVAILABLE: the daemon went away (e.g. restarting); the next
                # call waits for it to come back.
        raise DeadlineExceeded(
            f"refitd at {self.address} not ready within {timeout}s "
            f"(last readiness {last})"
        )
