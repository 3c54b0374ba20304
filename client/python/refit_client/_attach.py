"""Engine attach: serve a model group straight from refitd's memory.

    from refit_client import attach

    engine = attach("unix:/run/refitd.sock")         # coordinate=True
    w = engine.tensors["model.layers.0.mlp.down_proj.weight"]   # zero-copy, read-only
    while serving:
        engine.safe_point()       # between forward steps; blocks only during a commit
        logits = forward(engine.tensors, tokens)

`attach` opens the lease (an EngineService.Attach stream over the daemon's
Unix socket), receives the manifest and the arena's memfd (SCM_RIGHTS on the
socket beside it), maps it read-only and builds one torch tensor per kernel
over the mapping. The tensors keep their storage for the daemon's lifetime:
every commit writes the new version into the same bytes. A CUDA store's
kernels are opened from their CUDA IPC handle instead (CUDA tensors); that
device mapping lasts as long as any tensor over it (or a view of one), and
is undone, after the device's queued work, once the last is gone.

With coordinate=True the daemon waits, before each commit copies, until the
engine has passed a safe_point() (or --engine-quiesce-timeout passes: then the
commit does not happen). Without it the engine only learns of versions, and
`consistent(fn)` re-runs `fn` until it read one version (the arena's seqlock).
Committed events come from the arena's header the moment the daemon's copy
ends (a thread asleep on the header's futex delivers them), ahead of the same
message on the stream, which is then dropped.
The CPU tensors are views of memory mapped read-only: writing to one kills the
process (SIGSEGV). On a GPU it depends on the daemon's --cuda-arena: with
"vmm" the kernels are a virtual-memory allocation whose descriptor comes with
the memfd, mapped here with read-only access, so a kernel that writes to one
faults (the engine's CUDA context is lost; ``read_only_device`` is True).
With "ipc" (the default) they are opened from a CUDA IPC handle, which has no
read-only mapping: the CUDA tensors are writable, and an engine that writes
to one changes what every attached engine serves until the next commit
overwrites those bytes.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import logging
import mmap
import os
import platform
import queue
import struct
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import grpc

from . import _fdsocket
from ._expiry import CallExpiry
from ._proto import engine_pb2 as epb
from ._proto import engine_pb2_grpc as epb_grpc
from .errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    RefitError,
    Unavailable,
    from_rpc_error,
)

_log = logging.getLogger("refit_client")

__all__ = ["attach", "safe_point_all", "AttachedEngine", "EngineEvent", "LAYOUT_FIELDS"]

# Offsets of the arena header (core/arena.h): magic, then seq and version;
# the fingerprint and refit id of the version (NUL-padded ASCII; all zero
# from a daemon that does not write them, which leaves Committed to the
# stream).
_MAGIC = b"REFITAR1"
_FORMAT = 1  # the header format this client reads
_SEQ_OFFSET = 40
_VERSION_OFFSET = 48
_COMMITTED_NS_OFFSET = 56

try:
    # Whole 64-bit loads with a read fence and acquire ordering: what a seqlock
    # reader needs on AArch64 as on x86-64 (_atomics.c says why).
    from ._atomics import load_acquire as _load_acquire

    ORDERED_HEADER_READS = True
except ImportError:  # built without a C compiler
    ORDERED_HEADER_READS = platform.machine().lower() in ("x86_64", "amd64")

    def _load_acquire(buffer: Any, offset: int) -> int:
        # struct's loads: in order on x86-64, which keeps loads in order.
        return struct.unpack_from("<Q", buffer, offset)[0]

_FINGERPRINT = slice(64, 96)
_REFIT_ID = slice(96, 224)

# The daemon wakes the shared futex on seq's low 32 bits as each commit's copy
# ends (core/arena.h): a safe point sleeps on it instead of waiting for the
# Committed message (two thread hops and the stream away).
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Futex:
    """FUTEX_WAIT / FUTEX_WAKE (shared, not private) on one 32-bit word of a
    mapping; ctypes releases the GIL during the call."""

    def __init__(self, address: int) -> None:
        self.address = address
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._syscall.restype = ctypes.c_long

    def wait(self, expected: int, seconds: float) -> None:
        ts = _Timespec(int(seconds), int((seconds % 1) * 1e9))
        self._syscall(
            ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(self.address), ctypes.c_int(_FUTEX_WAIT),
            ctypes.c_uint32(expected), ctypes.byref(ts), None, ctypes.c_int(0),
        )  # woken, timed out, EAGAIN or EINTR: the caller looks again

    def wake(self) -> None:
        self._syscall(
            ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(self.address), ctypes.c_int(_FUTEX_WAKE),
            ctypes.c_int(2**31 - 1), None, None, ctypes.c_int(0),
        )


# The daemon's refusal of an attach before its first version is served.
_NO_VERSION_YET = "serves no version yet"

LAYOUT_FIELDS = (
    "architecture",
    "tp_rank",
    "tp_size",
    "checkpoint_dtype",
    "quantization",
    "quant_config_hash",
    "tensors_hash",
    "checkpoint_id",
    "fingerprint",
)


@dataclass(frozen=True)
class EngineEvent:
    """A version event: kind is "commit_pending", "committed" or "aborted".

    `via` says how it arrived: "stream" (the Attach stream), or "arena" for a
    Committed read from the arena's header as the daemon's copy ended, ahead
    of the same event on the stream (which is then not delivered again)."""

    kind: str
    refit_id: str
    version: int
    fingerprint: str = ""
    reason: str = ""
    time: float = 0.0  # time.monotonic() when it arrived
    via: str = "stream"


def _torch_dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"arena tensor dtype {name!r} is not a torch dtype")
    return dtype


def _receive_fds(path: str, ticket: str, timeout: float) -> List[int]:
    """The descriptors the daemon hands for `ticket`, in order: the arena's
    memfd first, then (a GPU arena shared as a virtual-memory allocation)
    that allocation's."""
    msg, fds = _fdsocket.exchange(path, ticket, timeout)
    if msg[:1] == b"K" and fds:
        return fds
    for fd in fds:
        os.close(fd)
    text = msg[1:].decode(errors="replace").strip() or "no descriptor"
    raise PermissionDenied(f"attach: the daemon refused the arena descriptor: {text}")


class _CuMemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CuMemAccessDesc(ctypes.Structure):
    _fields_ = [("location", _CuMemLocation), ("flags", ctypes.c_int)]


_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READ = 1


class _DeviceMapping:
    """A device arena of the daemon mapped into this process, undone once
    nothing refers to it. Every tensor over it holds it (torch keeps the
    object a CUDA tensor was built from, a _DevicePointer, as long as the
    tensor's storage), so it goes with the last tensor or view over it, never
    before: an engine that re-attaches after a daemon restart lets go of the
    old arena's device memory as it drops the old tensors. `unmap` waits for
    the device's queued work first (a kernel may still read the bytes). When
    CUDA cannot do it then (a graph capture under way), it is done at the
    next safe point, attach or close (_deferred_unmaps)."""

    def __init__(self, ptr: int, unmap: Callable[[], None]) -> None:
        self.ptr = ptr
        self.released = weakref.finalize(self, _unmap_once, unmap)
        # At exit the process' mappings end with it.
        self.released.atexit = False


# Unmaps that could not be done when they came due: on a thread capturing a
# CUDA graph (the last tensor over an arena dropped there, by the garbage
# collector say), where the device sync an unmap starts with would invalidate
# the capture; or refused, as CUDA refuses a device sync or an unmap on every
# thread while another captures in the global mode (torch's default), so a
# finalizer on a reader thread fails then. They are done at the next safe
# point, attach or close (_drain_deferred_unmaps), each tried up to
# _UNMAP_TRIES times in all.
_deferred_unmaps: "collections.deque[Tuple[Callable[[], None], int]]" = collections.deque()
_UNMAP_TRIES = 3


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph."""
    import torch

    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - no CUDA state to capture with
        return False


def _unmap_once(unmap: Callable[[], None]) -> None:
    if _capturing():
        _deferred_unmaps.append((unmap, 0))
        return
    _run_unmap(unmap, 0)


def _run_unmap(unmap: Callable[[], None], tried: int) -> None:
    try:
        unmap()
    except Exception as e:  # noqa: BLE001 - a finalizer has no caller to raise to
        if tried + 1 < _UNMAP_TRIES:
            _deferred_unmaps.append((unmap, tried + 1))
        else:
            warnings.warn(
                f"attach: unmapping a device arena failed {_UNMAP_TRIES} times, the last: {e}",
                RuntimeWarning,
            )


def _drain_deferred_unmaps() -> None:
    """The unmaps deferred (see _deferred_unmaps), unless this thread is
    capturing; each one once per call (one that fails again waits for the
    next call)."""
    for _ in range(len(_deferred_unmaps)):
        if _capturing():
            return
        try:
            unmap, tried = _deferred_unmaps.popleft()
        except IndexError:  # another thread took the last one
            return
        _run_unmap(unmap, tried)


class _CudaVmm:
    """Maps a CUDA virtual-memory allocation another process exported as a
    POSIX file descriptor, with read-only access, through the CUDA driver
    torch has loaded: cuMemImportFromShareableHandle, cuMemAddressReserve,
    cuMemMap, cuMemSetAccess(PROT_READ). A kernel that writes to it faults
    (the engine's CUDA context is lost; the daemon's bytes are untouched).
    The mapping lasts while any tensor over it does (_DeviceMapping):
    cuMemUnmap and cuMemAddressFree then give the allocation back."""

    def __init__(self) -> None:
        import torch

        torch.cuda.init()
        try:
            self.cu = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RefitError(
                f"attach: no CUDA driver (libcuda.so.1) in this process: {e}"
            ) from None
        cu = self.cu
        u64 = ctypes.c_ulonglong
        size = ctypes.c_size_t
        cu.cuMemImportFromShareableHandle.argtypes = [
            ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int
        ]
        cu.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), size, size, u64, u64]
        cu.cuMemMap.argtypes = [u64, size, size, u64, u64]
        cu.cuMemSetAccess.argtypes = [u64, size, ctypes.POINTER(_CuMemAccessDesc), size]
        cu.cuMemRelease.argtypes = [u64]
        cu.cuMemUnmap.argtypes = [u64, ctypes.c_size_t]
        cu.cuMemAddressFree.argtypes = [u64, ctypes.c_size_t]
        for fn in ("cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap",
                   "cuMemSetAccess", "cuMemRelease", "cuMemUnmap", "cuMemAddressFree"):
            getattr(cu, fn).restype = ctypes.c_int

    def _check(self, what: str, err: int) -> None:
        if err != 0:
            raise RefitError(f"attach: {what} failed (CUDA driver error {err})")

    def map_read_only(self, fd: int, nbytes: int, device: int) -> _DeviceMapping:
        """The whole allocation behind `fd` (`nbytes` long), mapped
        read-only on `device`. Does not take `fd`."""
        import torch

        cu = self.cu
        u64 = ctypes.c_ulonglong
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # torch's (primary) context exists and is current
            handle = u64()
            self._check(
                "cuMemImportFromShareableHandle",
                cu.cuMemImportFromShareableHandle(
                    ctypes.byref(handle),
                    ctypes.c_void_p(fd),
                    _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                ),
            )
            ptr = u64()
            try:
                self._check(
                    "cuMemAddressReserve", cu.cuMemAddressReserve(ctypes.byref(ptr), nbytes, 0, 0, 0)
                )
                try:
                    self._check("cuMemMap", cu.cuMemMap(ptr, nbytes, 0, handle, 0))
                    access = _CuMemAccessDesc(
                        _CuMemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, device),
                        _CU_MEM_ACCESS_FLAGS_PROT_READ,
                    )
                    err = cu.cuMemSetAccess(ptr, nbytes, ctypes.byref(access), 1)
                    if err != 0:
                        cu.cuMemUnmap(ptr, nbytes)
                        self._check("cuMemSetAccess", err)
                except BaseException:
                    cu.cuMemAddressFree(ptr, nbytes)
                    raise
            finally:
                # The mapping holds the allocation from now on.
                cu.cuMemRelease(handle)
        address = int(ptr.value)

        def unmap() -> None:
            with torch.cuda.device(device):
                torch.cuda.synchronize(device)  # no queued kernel reads it any more
                self._check("cuMemUnmap", cu.cuMemUnmap(address, nbytes))
                self._check("cuMemAddressFree", cu.cuMemAddressFree(address, nbytes))

        return _DeviceMapping(address, unmap)


class _CudaIpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _IpcOpened:
    """One CUDA IPC handle opened in this process; closed once."""

    def __init__(self, key: Tuple[bytes, int], ptr: int) -> None:
        self.key = key
        self.ptr = ptr
        self.closed = False


class _CudaIpc:
    """cudaIpcOpenMemHandle through the CUDA runtime torch has loaded.

    Opening the same allocation twice in one process is an error, so a
    handle is opened once and shared: a second attach to the same arena gets
    the first one's mapping while any tensor over it lives. Once the last is
    gone the handle is closed (cudaIpcCloseMemHandle) and forgotten, so a
    daemon that frees the allocation (it restarted) leaves no mapping of it
    here."""

    # (handle, device) -> the mapping (weakly) and what closes it. Reentrant:
    # a mapping's finalizer may run on a thread that holds it (a garbage
    # collection during open()).
    _opened: Dict[Tuple[bytes, int], Tuple["weakref.ref[_DeviceMapping]", _IpcOpened]] = {}
    _opened_mu = threading.RLock()

    def __init__(self) -> None:
        import torch

        torch.cuda.init()
        lib = None
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcudart" in line:
                    lib = line.split()[-1]
                    break
        if lib is None:
            raise RefitError("attach: no CUDA runtime loaded in this process")
        self.rt = ctypes.CDLL(lib)

    def open(self, handle: bytes, device: int) -> _DeviceMapping:
        if len(handle) != ctypes.sizeof(_CudaIpcMemHandle):
            raise RefitError(
                f"attach: the daemon sent a CUDA IPC handle of {len(handle)} bytes, "
                f"expected {ctypes.sizeof(_CudaIpcMemHandle)}"
            )
        key = (handle, device)
        with _CudaIpc._opened_mu:
            entry = _CudaIpc._opened.get(key)
            if entry is not None:
                mapping = entry[0]()
                if mapping is not None:
                    return mapping
                # Its last tensor is gone and its finalizer not yet run:
                # the handle is closed here first, to be opened anew.
                self._close_once(entry[1])
            opened = _IpcOpened(key, self._open(handle, device))
            mapping = _DeviceMapping(opened.ptr, lambda: self._release(opened))
            _CudaIpc._opened[key] = (weakref.ref(mapping), opened)
            return mapping

    def _release(self, opened: _IpcOpened) -> None:
        with _CudaIpc._opened_mu:
            self._close_once(opened)

    def _close_once(self, opened: _IpcOpened) -> None:
        # Under _opened_mu. Forgotten only once closed: a close that failed
        # leaves the handle open, and known, so the next open of it closes
        # it first instead of opening it a second time (which CUDA refuses).
        if opened.closed:
            return
        self._close(opened.ptr, opened.key[1])
        opened.closed = True
        entry = _CudaIpc._opened.get(opened.key)
        if entry is not None and entry[1] is opened:
            del _CudaIpc._opened[opened.key]

    def _close(self, ptr: int, device: int) -> None:
        import torch

        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # no queued kernel reads it any more
            self.rt.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
            self.rt.cudaIpcCloseMemHandle.restype = ctypes.c_int
            err = self.rt.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))
            if err != 0:
                self.rt.cudaGetLastError()  # (as in _open)
                raise RefitError(f"attach: cudaIpcCloseMemHandle failed (CUDA error {err})")

    def _open(self, handle: bytes, device: int) -> int:
        import torch

        with torch.cuda.device(device):
            ptr = ctypes.c_void_p()
            # cudaIpcMemHandle_t is a struct passed by value (an array
            # argument would decay to a pointer); flag 1 is
            # cudaIpcMemLazyEnablePeerAccess.
            self.rt.cudaIpcOpenMemHandle.argtypes = [
                ctypes.POINTER(ctypes.c_void_p),
                _CudaIpcMemHandle,
                ctypes.c_uint,
            ]
            self.rt.cudaIpcOpenMemHandle.restype = ctypes.c_int
            err = self.rt.cudaIpcOpenMemHandle(
                ctypes.byref(ptr), _CudaIpcMemHandle.from_buffer_copy(handle), 1
            )
            if err != 0:
                # The runtime keeps the error as the thread's last error;
                # clear it, or torch's next CUDA call would report it.
                self.rt.cudaGetLastError()
                raise RefitError(f"attach: cudaIpcOpenMemHandle failed (CUDA error {err})")
            return int(ptr.value or 0)


class _DevicePointer:
    """Presents a device mapping to torch.as_tensor as uint8 bytes. The
    tensor's storage keeps this object, and so the mapping, alive.

    Not flagged read-only: torch refuses that flag for CUDA memory, and a
    CUDA IPC mapping is read-write anyway (see the module docstring)."""

    def __init__(self, mapping: _DeviceMapping, nbytes: int) -> None:
        self.mapping = mapping
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (mapping.ptr, False),
            "version": 2,
        }


def _check_header(header: Any, a: Any) -> None:
    """The arena header against the manifest (`a`, an Attached): the format
    this client reads, where the data starts, that a host arena holds its
    data, and the layout hash, which is the manifest's layout fingerprint as
    a number. FailedPrecondition naming the field otherwise."""
    host = a.regions[0]
    if len(header) < 40:
        raise FailedPrecondition(f"attach: the arena is {len(header)} bytes, shorter than its header")
    fmt, _, data_offset, data_bytes, layout_hash = struct.unpack_from("<IIQQQ", header, 8)
    if fmt != _FORMAT:
        raise FailedPrecondition(
            f"attach: the arena header is format {fmt}; this client reads format {_FORMAT}")
    if data_offset != host.data_offset:
        raise FailedPrecondition(
            f"attach: the arena header puts the data at {data_offset}, the manifest at "
            f"{host.data_offset}")
    on_device = any(r.kind != epb.ArenaRegion.KIND_HOST_MEMFD for r in a.regions)
    if not on_device and data_offset + data_bytes > host.bytes:
        raise FailedPrecondition(
            f"attach: the arena header says {data_bytes} bytes of data at {data_offset}, past "
            f"the arena's {host.bytes} bytes")
    try:
        expected = int(a.layout.fingerprint, 16)
    except ValueError:
        raise FailedPrecondition(
            f"attach: the manifest's layout fingerprint {a.layout.fingerprint!r} is not hex"
        ) from None
    if layout_hash != expected:
        raise FailedPrecondition(
            f"attach: the arena's layout hash {layout_hash:016x} is not the manifest's layout "
            f"fingerprint {a.layout.fingerprint}")


def _local_cuda_device(region: Any, cuda: Any = None) -> int:
    """This process's ordinal of a CUDA region's device. The daemon's ordinal
    (region.cuda_device) names another device, or none, where
    CUDA_VISIBLE_DEVICES differs (a sidecar, a container given its GPUs in
    another order): the device is found by its UUID. `cuda` is torch.cuda
    (a seam for tests)."""
    if not region.cuda_device_uuid:
        return region.cuda_device  # a daemon that does not send the UUID
    if cuda is None:
        import torch

        cuda = torch.cuda
    visible = []
    for index in range(cuda.device_count()):
        uuid = bytes(cuda.get_device_properties(index).uuid.bytes)
        if uuid == region.cuda_device_uuid:
            return index
        visible.append(uuid.hex())
    raise FailedPrecondition(
        f"attach: the arena's GPU (UUID {bytes(region.cuda_device_uuid).hex()}, the daemon's "
        f"cuda:{region.cuda_device}) is not visible to this process "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}; visible: "
        f"{', '.join(visible) or 'none'})"
    )


class AttachedEngine:
    """An engine's lease on a model group's kernels. Thread-safe."""

    def __init__(
        self,
        address: str,
        group: Optional[str],
        coordinate: bool,
        name: str,
        expect: Optional[Dict[str, Any]],
        token: Optional[str],
        timeout: float,
        stated_timeout: Optional[float] = None,
    ) -> None:
        # `timeout` is what is left of the caller's `stated_timeout` (the
        # one an error names) after waiting for a first version.
        if not address.startswith("unix:"):
            raise FailedPrecondition(f"attach needs a local Unix socket; {address!r} is not unix:")
        self.address = address
        # The request first: a bad `expect` is refused before any channel.
        request = epb.AttachRequest(model_group=group or "", coordinate=coordinate, engine_name=name)
        for key, value in (expect or {}).items():
            if key not in LAYOUT_FIELDS:
                raise InvalidArgument(f"attach: expect has an unknown field {key!r}")
            want = type(getattr(request.expect, key))
            if not isinstance(value, want) or isinstance(value, bool):
                raise InvalidArgument(
                    f"attach: expect[{key!r}] is {value!r}, a {type(value).__name__}; the layout's "
                    f"{key} is a {want.__name__} (as engine.layout gives it)"
                )
            setattr(request.expect, key, value)
        self._channel = grpc.insecure_channel(address)
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._requests: "queue.Queue[Optional[Any]]" = queue.Queue()
        self._requests.put(epb.EngineMessage(attach=request))
        stub = epb_grpc.EngineServiceStub(self._channel)
        # The stream is the lease, so it has no deadline; `timeout` bounds
        # the wait for its first message (a daemon not there yet, or not
        # answering) by cancelling the call.
        self._call = stub.Attach(self._request_iter(), metadata=metadata, wait_for_ready=True)
        expiry = CallExpiry(self._call)
        stated = timeout if stated_timeout is None else stated_timeout
        expiry.after(timeout, f"no answer from {address} within {stated:g} s")

        def give_up() -> None:
            self._requests.put(None)  # ends the request iterator
            self._channel.close()

        try:
            first = next(self._call)
        except grpc.RpcError as e:
            give_up()
            why = expiry.finish()
            if why is not None:
                raise DeadlineExceeded(f"attach: {why}") from None
            raise from_rpc_error(e, "attach") from None
        except StopIteration:
            give_up()
            raise RefitError("attach: the daemon ended the stream without a manifest") from None
        why = expiry.finish()
        if why is not None:  # cancelled just as the manifest came
            give_up()
            raise DeadlineExceeded(f"attach: {why}")
        a = first.attached
        self.engine_id: str = a.engine_id
        self.group: str = a.model_group
        self.coordinated: bool = a.coordinated
        self.layout: Dict[str, Any] = {f: getattr(a.layout, f) for f in LAYOUT_FIELDS}
        self.layout_fingerprint: str = a.layout.fingerprint
        self._cv = threading.Condition()
        self._version: int = a.version
        self._fingerprint: str = a.fingerprint
        self._pending: Optional[Tuple[str, int, int]] = None  # (refit id, version, attempt)
        if a.HasField("pending"):
            # Attached while a commit is pending: the first safe point holds
            # for it, whenever the stream's CommitPending is read.
            self._pending = (a.pending.refit_id, a.pending.version, a.pending.attempt)
        self._acked = False
        # Events set whenever the pending commit changes (safe_point_all).
        self._listeners: List[threading.Event] = []
        self._closed: Optional[BaseException] = None
        self._closing = False
        self._sleeping = False  # a safe point sleeps on the header's futex
        self._callbacks: List[Callable[[EngineEvent], None]] = []
        self._events: "queue.Queue[Optional[EngineEvent]]" = queue.Queue()
        # Events are delivered by two threads (the stream's reader and the
        # arena watcher): one at a time, in order, each Committed once.
        self._deliver_mu = threading.Lock()
        self._local = threading.local()  # .delivering: in an on_event callback
        self._delivered: int = a.version  # the newest version delivered
        self.pauses: List[Tuple[int, float]] = []  # (version, seconds) of each safe_point pause
        # The CUDA tensors are mapped with read-only access (a daemon with
        # --cuda-arena=vmm); False for host tensors (read-only anyway) and
        # for CUDA IPC mappings (writable).
        self.read_only_device = False
        # The devices the arena's CUDA tensors are on (none for a host store):
        # a safe point waits for their queued work before it acks.
        self._cuda_devices: Tuple[int, ...] = ()
        # The device mappings, held weakly: the tensors keep them.
        self._device_mappings: List["weakref.ref[_DeviceMapping]"] = []
        try:
            self._build(a, timeout)
        except BaseException:
            self.close()
            raise
        self._reader = threading.Thread(target=self._read_events, daemon=True)
        self._reader.start()
        self._watcher: Optional[threading.Thread] = None
        if self._futex is not None:
            self._watcher = threading.Thread(target=self._watch_arena, daemon=True)
            self._watcher.start()

    # -- setup -------------------------------------------------------------

    def _request_iter(self) -> Iterator[Any]:
        while True:
            item = self._requests.get()
            if item is None:
                return
            yield item

    def _build(self, a: Any, timeout: float) -> None:
        fds = _receive_fds(a.fd_socket, a.ticket, timeout)
        try:
            self._build_on(a, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _build_on(self, a: Any, fds: List[int]) -> None:
        import torch

        _drain_deferred_unmaps()
        host = a.regions[0]
        self._map = mmap.mmap(fds[0], host.bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        if self._map[:8] != _MAGIC:
            raise FailedPrecondition("attach: the arena does not start with the refitd header")
        _check_header(self._map, a)
        bases: Dict[int, Any] = {}
        with warnings.catch_warnings():
            # The mapping is read-only by design; torch warns about that.
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.frombuffer(self._map, dtype=torch.uint8)
            bases[0] = whole[host.data_offset :]
        self._futex: Optional[_Futex] = None
        if _SYS_FUTEX is not None:
            self._futex = _Futex(whole.data_ptr() + _SEQ_OFFSET)
        devices = set()
        for index, region in enumerate(a.regions):
            if region.kind in (epb.ArenaRegion.KIND_CUDA_IPC, epb.ArenaRegion.KIND_CUDA_VMM):
                device = _local_cuda_device(region)
            if region.kind == epb.ArenaRegion.KIND_CUDA_IPC:
                mapping = _CudaIpc().open(region.cuda_ipc_handle, device)
            elif region.kind == epb.ArenaRegion.KIND_CUDA_VMM:
                if region.fd_index >= len(fds):
                    raise RefitError(
                        f"attach: the daemon sent {len(fds)} descriptors, the device arena is "
                        f"number {region.fd_index}"
                    )
                mapping = _CudaVmm().map_read_only(fds[region.fd_index], region.bytes, device)
                self.read_only_device = True
            else:
                continue
            bases[index] = torch.as_tensor(
                _DevicePointer(mapping, region.bytes), device=f"cuda:{device}"
            )
            if bases[index].data_ptr() != mapping.ptr:
                # torch copied it to another device: commits would never reach the copy.
                raise RefitError(
                    f"attach: the arena mapped at {mapping.ptr:#x} on cuda:{device} came back as "
                    f"a copy at {bases[index].data_ptr():#x}"
                )
            self._device_mappings.append(weakref.ref(mapping))
            devices.add(device)
        self._cuda_devices = tuple(sorted(devices))
        self.tensors: Dict[str, Any] = {}
        # One typed view of each region per dtype, and each tensor a single
        # as_strided over it: a model has hundreds of kernel tensors, and
        # three torch calls apiece (slice, view, as_strided) were most of
        # the time attach takes. Per (region, dtype): the view, its element
        # size and storage offset, looked up once (attach's time is this loop).
        typed: Dict[Tuple[int, str], Any] = {}
        tensors = self.tensors
        for t in a.tensors:
            nbytes = t.nbytes
            key = (t.region, t.dtype)
            entry = typed.get(key)
            if entry is None:
                dtype = _torch_dtype(t.dtype)
                base = bases[t.region]
                size = torch.empty(0, dtype=dtype).element_size()
                usable = base.numel() - base.numel() % size
                view = base[:usable].view(dtype) if base.storage_offset() % size == 0 else None
                entry = (dtype, base, view, size, view.storage_offset() if view is not None else 0)
                typed[key] = entry
            dtype, base, view, size, start = entry
            if not nbytes:
                flat = torch.empty(0, dtype=dtype, device=base.device)
                tensors[t.name] = flat.as_strided(tuple(t.shape), tuple(t.strides))
                continue
            offset = t.byte_offset
            if view is not None and offset % size == 0:
                tensors[t.name] = view.as_strided(
                    tuple(t.shape), tuple(t.strides), start + offset // size
                )
            else:  # an offset the typed view cannot express
                raw = base[offset : offset + nbytes]
                tensors[t.name] = raw.view(dtype).as_strided(tuple(t.shape), tuple(t.strides))

    # -- events --------------------------------------------------------------

    def _emit(self, event: EngineEvent) -> None:
        # Under _deliver_mu.
        self._events.put(event)
        self._local.delivering = True
        try:
            for callback in list(self._callbacks):
                try:
                    callback(event)
                except Exception:
                    # The lease and the other callbacks go on: a reader
                    # thread that died here would leave safe points waiting
                    # for events no one delivers.
                    _log.exception("attach: an on_event callback raised on %s", event.kind)
        finally:
            self._local.delivering = False

    def _committed(self, refit_id: str, version: int, fingerprint: str, via: str) -> None:
        """Delivers Committed for `version` unless it (or a newer one) was."""
        with self._deliver_mu:
            with self._cv:
                if version <= self._delivered:
                    return
                self._delivered = version
                self._version = version
                self._fingerprint = fingerprint
                if self._pending is not None and self._pending[1] <= version:
                    self._pending = None
                self._changed()
            event = EngineEvent(
                "committed", refit_id, version, fingerprint, time=time.monotonic(), via=via
            )
            self._emit(event)

    def _read_events(self) -> None:
        try:
            for message in self._call:
                kind = message.WhichOneof("kind")
                if kind == "committed":
                    c = message.committed
                    self._committed(c.refit_id, c.version, c.fingerprint, "stream")
                    continue
                with self._deliver_mu:
                    now = time.monotonic()
                    if kind == "commit_pending":
                        p = message.commit_pending
                        event = EngineEvent("commit_pending", p.refit_id, p.version, time=now)
                        with self._cv:
                            asked = (p.refit_id, p.version, p.attempt)
                            # (Already pending from the manifest, or already
                            # delivered from the header: nothing new to ack.)
                            if self._pending != asked and p.version > self._delivered:
                                self._pending = asked
                                self._acked = False
                            self._changed()
                    elif kind == "aborted":
                        b = message.aborted
                        event = EngineEvent(
                            "aborted", b.refit_id, b.version, reason=b.reason, time=now
                        )
                        with self._cv:
                            # (Another refit's end leaves this one pending.)
                            if self._pending is not None and self._pending[0] == b.refit_id:
                                self._pending = None
                            self._changed()
                        self._wake_safe_point()
                    else:
                        continue
                    self._emit(event)
            error: BaseException = RefitError("attach: the daemon ended the lease")
        except grpc.RpcError as e:
            error = from_rpc_error(e, "attach")
        with self._deliver_mu:
            with self._cv:
                self._closed = error
                self._pending = None
                self._changed()
            self._wake_safe_point()
            self._events.put(None)

    def _watch_arena(self) -> None:
        """Delivers each Committed from the arena's header the moment the
        daemon's copy ends (it wakes the header's futex then), instead of
        when the message has crossed the stream, gRPC's completion thread
        and the reader thread: about a millisecond on a busy host. The
        stream's copy of the event is then dropped as already delivered."""
        while True:
            futex = self._futex
            if futex is None or self._closing:
                return
            with self._cv:
                if self._closed is not None:
                    return
                if self._sleeping:
                    # A safe point sleeps on the futex for this commit and
                    # delivers its Committed as it wakes: one thread woken
                    # as the copy ends, not two contending for the GIL.
                    self._cv.wait(0.25)
                    continue
            seq, _version = self.header()
            self._deliver_from_arena()  # nothing while a copy is under way
            # Sleeps until the next copy ends (or seq already moved on: at
            # once); slices bound how long a close takes to be noticed.
            futex.wait(seq & 0xFFFFFFFF, 0.25)

    def _deliver_from_arena(self) -> None:
        commit = self.arena_commit()
        if commit is not None and commit[1]:  # no refit id: the stream's to deliver
            version, refit_id, fingerprint = commit
            self._committed(refit_id, version, fingerprint, "arena")

    def _wake_safe_point(self) -> None:
        # A safe point sleeping on the futex sees the pending commit gone.
        if self._futex is not None:
            self._futex.wake()

    @property
    def version(self) -> int:
        with self._cv:
            return self._version

    @property
    def fingerprint(self) -> str:
        with self._cv:
            return self._fingerprint

    @property
    def closed(self) -> Optional[BaseException]:
        """Why the lease ended, or None while it holds."""
        with self._cv:
            return self._closed

    def on_event(self, callback: Callable[[EngineEvent], None]) -> None:
        """Calls `callback(event)` for every later event, one at a time and in
        order: on the stream's reader thread, the arena watcher's, or (for a
        coordinated commit's Committed) the thread in safe_point(). A slow
        callback delays the next event, and a safe point's return. A callback
        may call safe_point() (an idle engine acking a commit_pending): that
        acks and returns False at once, and the next safe_point() on another
        thread holds until the copy has ended. An exception the callback
        raises is logged (logger "refit_client") and the events go on."""
        self._callbacks.append(callback)

    def events(self, timeout: Optional[float] = None) -> Iterator[EngineEvent]:
        """Every event since attach, in order; ends with the lease (or after
        `timeout` seconds without one)."""
        while True:
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                return
            if event is None:
                return
            yield event

    def safe_point(self, timeout: Optional[float] = None) -> bool:
        """Call between forward steps. Returns at once unless a coordinated
        commit is pending; then acks it and blocks until the daemon's copy has
        ended (the arena header shows the new version; this thread then
        delivers its Committed event from the header) or the daemon gave up
        (Aborted). True if it paused. From an on_event callback it acks and
        returns False without waiting (see on_event).

        On a GPU store the ack waits for the work queued on the arena's
        devices (torch.cuda.synchronize): kernels launched before the call
        may still read the tensors, and once acked the daemon's copy
        overwrites them."""
        _drain_deferred_unmaps()
        pending = self._ack_pending()
        if pending is None:
            return False
        version = pending[1]
        if getattr(self._local, "delivering", False):
            # An on_event callback: this thread delivers the events, so it
            # cannot wait for the Committed it would deliver. The ack is
            # sent; a safe point on another thread holds until the copy has
            # ended.
            return False
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        futex = self._futex
        if futex is not None:
            with self._cv:
                self._sleeping = True
            futex.wake()  # the watcher leaves the futex to this thread
            try:
                self._sleep_until_copied(pending, deadline)
                self._deliver_from_arena()
            finally:
                with self._cv:
                    self._sleeping = False
                    self._cv.notify_all()
        with self._cv:
            if self._pending == pending:
                if self._copied(version):
                    self._pending = None  # its Committed is on the way
                else:
                    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                    self._cv.wait_for(lambda: self._pending != pending, remaining)
            self.pauses.append((version, time.monotonic() - start))
            return True

    def _ack_pending(self) -> Optional[Tuple[str, int, int]]:
        """Acks the pending commit unless it was; returns it (None: none)."""
        while True:
            with self._cv:
                pending = self._pending
                if pending is None or self._acked:
                    return pending
            # Outside the lock: the other threads' events go on meanwhile.
            self._sync_devices()
            with self._cv:
                if self._pending == pending and not self._acked:
                    self._acked = True
                    refit_id, version, attempt = pending
                    self._requests.put(
                        epb.EngineMessage(
                            quiesced=epb.Quiesced(
                                refit_id=refit_id, version=version, attempt=attempt
                            )
                        )
                    )
                    return pending
            # Aborted, or asked again, while the devices synchronized: look again.

    def _pending_now(self) -> Optional[Tuple[str, int, int]]:
        """The pending commit, None once none is or its copy has ended (the
        arena header shows its version; the Committed is on the way)."""
        with self._cv:
            pending = self._pending
            if pending is not None and self._copied(pending[1]):
                self._pending = None
                pending = None
            return pending

    def _changed(self) -> None:
        # Under _cv: the pending commit changed (asked, committed, aborted,
        # lease ended).
        self._cv.notify_all()
        for listener in self._listeners:
            listener.set()

    def _sync_devices(self) -> None:
        """Waits until the work queued on the arena's devices has run. Nothing
        (and no torch.cuda call) for a host store."""
        if not self._cuda_devices:
            return
        import torch

        for device in self._cuda_devices:
            torch.cuda.synchronize(device)

    def _copied(self, version: int) -> bool:
        seq, live = self.header()
        return seq % 2 == 0 and live >= version

    def _sleep_until_copied(self, pending: Tuple[str, int], deadline: Optional[float]) -> None:
        assert self._futex is not None
        while True:
            seq, live = self.header()
            if seq % 2 == 0 and live >= pending[1]:
                return
            with self._cv:
                if self._pending != pending:
                    return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            # Slices bound how long a missed wake can cost.
            slice_s = 0.05 if deadline is None else min(0.05, deadline - now)
            self._futex.wait(seq & 0xFFFFFFFF, slice_s)

    def header(self) -> Tuple[int, int]:
        """(seq, version) from the arena header, read without any RPC: seq is
        odd while a commit copies."""
        seq = _load_acquire(self._map, _SEQ_OFFSET)
        return seq, _load_acquire(self._map, _VERSION_OFFSET)

    def arena_commit(self) -> Optional[Tuple[int, str, str]]:
        """(version, refit_id, fingerprint) of the arena's latest commit, read
        from the header without any RPC; None while a commit copies. Empty
        strings where the daemon recorded none (a restored version)."""
        for _ in range(100):
            seq, version = self.header()
            if seq % 2:
                return None
            fingerprint = bytes(self._map[_FINGERPRINT])
            refit_id = bytes(self._map[_REFIT_ID])
            if _load_acquire(self._map, _SEQ_OFFSET) == seq:
                return (
                    version,
                    refit_id.split(b"\0", 1)[0].decode("ascii", "replace"),
                    fingerprint.split(b"\0", 1)[0].decode("ascii", "replace"),
                )
        return None

    def committed_at(self) -> Tuple[int, float]:
        """(version, time.time()) of the arena's latest commit: the version its
        bytes hold and when the daemon's copy of it ended, read from the
        header without any RPC (time 0.0 before the first commit). Tells an
        engine how old what it serves is, and how long a Committed event took
        to arrive."""
        for _ in range(1000):
            seq, version = self.header()
            nanos = _load_acquire(self._map, _COMMITTED_NS_OFFSET)
            if seq % 2 == 0 and _load_acquire(self._map, _SEQ_OFFSET) == seq:
                return version, nanos / 1e9
            time.sleep(0)
        raise RefitError("attach: the arena header stayed mid-commit")

    def consistent(self, fn: Callable[[], Any], attempts: int = 1000) -> Any:
        """Runs `fn` until it ran entirely inside one version (the seqlock:
        seq even and unchanged around it). For a CUDA arena, `fn` must
        synchronize its reads before it returns."""
        for _ in range(attempts):
            before, _version = self.header()
            if before % 2:
                time.sleep(0)
                continue
            result = fn()
            after, _version = self.header()
            if after == before:
                return result
        raise RefitError(f"attach: no read inside one version in {attempts} attempts")

    def close(self) -> None:
        """Ends the lease (the daemon releases the engine at once)."""
        self._closing = True  # the arena watcher stops at its next look
        self._requests.put(None)
        try:
            self._call.cancel()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
        self._channel.close()
        _drain_deferred_unmaps()

    def __enter__(self) -> "AttachedEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def attach(
    address: str,
    group: Optional[str] = None,
    coordinate: bool = True,
    *,
    name: str = "",
    expect: Optional[Dict[str, Any]] = None,
    token: Optional[str] = None,
    token_file: Optional[str] = None,
    timeout: float = 10.0,
) -> AttachedEngine:
    """Attaches to `group` (None: the daemon's default) of the refitd at
    `address` (a unix: address). `expect` holds layout fields the engine
    requires (LAYOUT_FIELDS); a difference is FailedPrecondition naming
    them. `timeout` bounds attaching: reaching the daemon, its first version
    (a daemon still loading it is waited for) and its answer
    (DeadlineExceeded), then the descriptor handover; the lease itself has
    no deadline. Raises the typed errors of refit_client.errors."""
    if token is not None and token_file is not None:
        raise InvalidArgument("give token or token_file, not both")
    if token_file is not None:
        with open(token_file) as f:
            lines = f.read().splitlines()
        token = lines[0].strip() if lines else ""
    if not ORDERED_HEADER_READS:
        warnings.warn(
            "attach: refit_client._atomics was not built (no C compiler when the package was "
            f"installed); on {platform.machine()} the arena header's seqlock reads are not "
            "ordered, so consistent() can miss a commit. Reinstall refit-client with a C compiler.",
            RuntimeWarning,
            stacklevel=2,
        )
    # Building hundreds of tensors allocates thousands of objects: enough to
    # set off a full cyclic collection of the engine's heap (tens of ms in a
    # process with torch loaded) in the middle of attach. It runs later.
    collecting = gc.isenabled()
    gc.disable()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return AttachedEngine(address, group, coordinate, name, expect, token,
                                      max(deadline - time.monotonic(), 0.001), timeout)
            except Unavailable as e:
                # A daemon still loading its first version: wait for it.
                if _NO_VERSION_YET not in str(e) or time.monotonic() + 0.05 >= deadline:
                    raise
                time.sleep(0.05)
    finally:
        if collecting:
            gc.enable()



def safe_point_all(engines: Sequence[AttachedEngine], timeout: Optional[float] = None) -> bool:
    """One safe point for an engine attached to several model groups (a
    target and its draft): call it between forward steps instead of each
    attachment's safe_point(). It acks every pending commit, keeps acking
    the ones asked while it waits, and returns once none of them is pending
    (every copy ended, or the daemon gave up) or `timeout` passed. True if
    it paused.

    A linked commit copies once the engines of all its groups have acked,
    so `a.safe_point(); b.safe_point()` would hold in a's safe point,
    waiting for a copy that waits for b's ack, until
    --engine-quiesce-timeout fails the commit. From an on_event callback it
    acks and returns False without waiting, as safe_point() does."""
    engines = list(engines)
    _drain_deferred_unmaps()
    if any(getattr(e._local, "delivering", False) for e in engines):
        for e in engines:
            e._ack_pending()
        return False
    changed = threading.Event()
    registered: List[AttachedEngine] = []
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    paused: Dict[int, int] = {}  # index in engines -> the version it paused for
    try:
        for e in engines:
            with e._cv:
                e._listeners.append(changed)
            registered.append(e)
        while True:
            changed.clear()
            waiting = False
            for i, e in enumerate(engines):
                pending = e._ack_pending()
                if pending is None:
                    continue
                paused[i] = pending[1]
                if e._pending_now() is not None:
                    waiting = True
            if not waiting:
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            # Woken by any attachment's change (its stream's CommitPending,
            # Committed or Aborted, or the arena watcher's Committed as the
            # copy ends); the slice bounds a wake missed for a closed one.
            changed.wait(0.05 if deadline is None else min(0.05, deadline - now))
    finally:
        for e in registered:
            with e._cv:
                e._listeners.remove(changed)
    for i in paused:
        # A copy seen ended in the header: its Committed (version,
        # fingerprint, the event) is delivered before this returns, as a
        # safe_point() does.
        engines[i]._deliver_from_arena()
    elapsed = time.monotonic() - start
    for i, version in paused.items():
        engines[i].pauses.append((version, elapsed))
    return bool(paused)
