"""The shared-memory lane of push(): chunks that reference bytes in the
trainer's shared memory instead of carrying them (refit.v1.RegionService,
Chunk.region). Only over the daemon's Unix socket.

A region is registered once and cached by the client: RegisterRegion's
response stream is its lease (it ends when the client closes, its process
dies, or the region is dropped here), the descriptor goes to the daemon's
descriptor socket with SCM_RIGHTS.

- A CPU torch tensor whose storage is already shared (share_memory_(),
  model.share_memory(), a DataLoader worker's tensors) is sent with no copy:
  its storage's descriptor is registered (once per storage) and the chunks
  point into it. Such a descriptor (a /dev/shm file) cannot be sealed; the
  daemon maps it under its SIGBUS guard and reads it in place all the same,
  and a storage truncated under a refit fails that refit.
- Tensors made by shared_tensors() live in a memfd sealed against shrinking
  that the client registers once: no copy anywhere but the daemon's own
  staging (the daemon maps it). A trainer that keeps its weights there
  (copies each update into them, or trains them in place) pushes with no
  copy at all.
- A CUDA tensor goes by its allocation's CUDA IPC handle (torch's
  ``_share_cuda_()``: the caching allocator's segment, the tensor's offset
  in it) and its GPU's UUID: the daemon opens the allocation and copies the
  rows of quantized weights device to device into its staging (the rest
  through host memory). These leases last one push: the daemon holds an
  opened allocation, which keeps its memory allocated, only while it reads.
  The devices are synchronized before the chunks go. torch shares a storage
  by wrapping it in a record that counts a reference for the receiving
  process, which only the receiver gives back (refitd, not a torch process,
  does not): a storage freed while counted keeps its memory for good. So
  each storage is shared once while it lives (again, each share would add a
  record and an interprocess event to it), and the reference its share
  counted is given back as the push that shared it ends, however it ends.
  A daemon that cannot
  open them (no GPU, not the same GPUs visible, built without CUDA) makes
  the lane copy CUDA tensors into the staging region instead, from then on
  (``cuda_ipc_fallback_reason``).
- Every other tensor is copied once into the client's staging region, a
  memfd sealed the same way, which the daemon maps and ingests in place.
  The staging region is reused by later pushes (grown when a push needs
  more) and costs host memory of the size of those tensors while the
  client lives.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import mmap
import os
import re
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple, Union

import grpc
import numpy as np

from . import _fdsocket, _tensors
from ._expiry import CallExpiry
from ._proto import region_pb2 as rpb
from ._proto import region_pb2_grpc as rpb_grpc
from .errors import DeadlineExceeded, RefitError, ResourceExhausted, from_rpc_error

_ALIGN = 256
# Shared storages registered per client; the oldest is dropped beyond this.
# The daemon's own limits (--max-regions-per-caller, 1024 by default, and
# --max-region-bytes-per-caller) are met by dropping the least recently used
# storages that the push in progress does not use, as its refusals come.
MAX_CACHED_REGIONS = 4096
# Registrations dropped at a time when the daemon refuses one over its limits.
_EVICT_BATCH = 64
_FD_SOCKET_TIMEOUT = 10.0
# A registration's handshake in all (ticket, descriptor, registration), and
# how long a refused descriptor's lease may take to end with its reason.
_REGISTER_TIMEOUT = _FD_SOCKET_TIMEOUT + 20.0
_REFUSED_GRACE = 2.0


# The daemon's error for a region whose file shrank while it read it.
_TRUNCATED = re.compile(r'region "([^"]+)" was truncated while in use')


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Lease:
    """One registered region: its id, size, how the daemon reads it
    ("mapped" or "pread"), and the RegisterRegion call that keeps it."""

    def __init__(self, call: Any, region_id: str, size: int, access: str) -> None:
        self._call = call
        self.region_id = region_id
        self.region_id_bytes = region_id.encode()
        self.size = size
        self.access = access

    def alive(self) -> bool:
        """False once the lease ended (released, or the daemon went away:
        a restarted daemon knows none of the old regions)."""
        return self._call.is_active()

    def release(self) -> None:
        self._call.cancel()


def _send_fd(path: str, ticket: str, fd: int) -> str:
    reply, fds = _fdsocket.exchange(path, ticket, _FD_SOCKET_TIMEOUT, fd)
    for received in fds:
        os.close(received)  # the daemon sends none here
    return reply.decode(errors="replace").strip()


def _access_name(access: int) -> str:
    if access == rpb.RegionRegistered.ACCESS_MAPPED:
        return "mapped"
    if access == rpb.RegionRegistered.ACCESS_CUDA_IPC:
        return "cuda_ipc"
    return "pread"


def _lease(call: Any, size: int, address: str, what: str, handshake: Any) -> Lease:
    """The lease of a RegisterRegion `call` once `handshake(events, expiry)`
    has returned its RegionRegistered, within _REGISTER_TIMEOUT; any failure
    cancels the call and raises (the daemon's error, DeadlineExceeded, or
    RefitError)."""
    expiry = CallExpiry(call)
    expiry.after(_REGISTER_TIMEOUT, f"no registration within {_REGISTER_TIMEOUT:g} s")
    try:
        registered = handshake(iter(call), expiry)
    except grpc.RpcError as e:
        call.cancel()
        why = expiry.finish()
        if why is not None:
            raise DeadlineExceeded(f"RegisterRegion at {address}: {why}") from None
        raise from_rpc_error(e, f"register a {what} at {address}") from None
    except StopIteration:
        call.cancel()
        raise RefitError("RegisterRegion: the stream ended early") from None
    except OSError as e:
        call.cancel()
        raise RefitError(f"RegisterRegion: descriptor socket: {e}") from None
    except BaseException:
        call.cancel()
        raise
    finally:
        expiry.finish()
    if expiry.why is not None:  # cancelled just as the registration came
        raise DeadlineExceeded(f"RegisterRegion at {address}: {expiry.why}")
    return Lease(call, registered.region_id, size, _access_name(registered.access))


def register_cuda(
    stub: Any, metadata: Any, handle: bytes, device_uuid: bytes, size: int, name: str,
    address: str,
) -> Lease:
    """Registers `size` bytes of a CUDA allocation from its base, by its IPC
    handle. Raises the daemon's error (FailedPrecondition without a GPU the
    daemon can see, InvalidArgument for a handle it cannot open, ...)."""
    call = stub.RegisterRegion(
        rpb.RegisterRegionRequest(
            size=size, name=name, cuda_ipc_handle=handle, cuda_device_uuid=device_uuid
        ),
        metadata=metadata,
    )

    def handshake(events: Any, expiry: CallExpiry) -> Any:
        first = next(events)
        if not first.HasField("registered"):
            raise RefitError("RegisterRegion: the daemon sent no registration for a CUDA region")
        return first.registered

    return _lease(call, size, address, "CUDA region", handshake)


def register(
    stub: Any, metadata: Any, fd: int, size: int, name: str, address: str
) -> Lease:
    """Registers `size` bytes of the descriptor `fd` (not taken: the caller
    keeps and closes its own). Raises the daemon's error (FailedPrecondition
    over TCP, ResourceExhausted over the per-caller limits, InvalidArgument
    for a descriptor too small, ...)."""
    call = stub.RegisterRegion(rpb.RegisterRegionRequest(size=size, name=name), metadata=metadata)

    def handshake(events: Any, expiry: CallExpiry) -> Any:
        first = next(events)
        if not first.HasField("ticket"):
            raise RefitError("RegisterRegion: the daemon sent no ticket")
        reply = _send_fd(first.ticket.fd_socket, first.ticket.ticket, fd)
        if not reply.startswith("K"):
            # Refused: the daemon ends the lease with its reason (which the
            # stream then raises, typed); if it does not, this does.
            expiry.after(_REFUSED_GRACE, f"the descriptor socket refused the region: {reply}")
        second = next(events)
        if not second.HasField("registered"):
            raise RefitError(f"RegisterRegion: no registration ({reply})")
        return second.registered

    return _lease(call, size, address, "shared-memory region", handshake)


def _shared_storage(src: _tensors.Source) -> Optional[Tuple[Any, int, int, int]]:
    """(storage, fd, byte offset of the tensor in it, storage bytes) for a
    CPU torch tensor in shared memory (file-descriptor sharing), else None."""
    t = src.tensor
    if t is None or t.device.type != "cpu" or not t.is_shared():
        return None
    storage = t.untyped_storage()
    try:
        # The descriptor the storage already has. (_share_fd_cpu_ would give
        # one to a storage shared another way, the file_system strategy or
        # a file mapping, by moving it into a new segment: this process's
        # tensors would then stop seeing what other processes write.)
        fd = storage._get_shared_fd()
    except (RuntimeError, AttributeError):
        return None  # shared without a descriptor, or empty: copied
    if fd < 0 or storage.nbytes() == 0:
        return None
    return storage, int(fd), t.data_ptr() - storage.data_ptr(), int(storage.nbytes())


CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def cuda_ipc_mem_handle(shared: object) -> Optional[bytes]:
    """The cudaIpcMemHandle_t inside the handle torch's caching allocator
    shares (``UntypedStorage._share_cuda_()[1]``), or None when there is none.

    Older torch returns the 64 handle bytes alone. Newer torch prefixes them
    with a version byte and a type byte: ``'c'`` for a block of a cudaMalloc
    allocation (the 64 bytes follow), ``'e'`` for an expandable segment
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), which has no
    cudaIpcMemHandle_t and cannot be opened by another process this way."""
    if not isinstance(shared, bytes):
        return None
    if len(shared) == CUDA_IPC_HANDLE_BYTES:
        return shared
    if len(shared) == CUDA_IPC_HANDLE_BYTES + 2 and shared[1:2] == b"c":
        return shared[2:]
    return None


class CudaShare:
    """What torch's ``_share_cuda_()`` gave for one CUDA storage: its
    allocation's cudaIpcMemHandle_t (None when there is none, as with
    expandable segments), the storage's size and its offset in the
    allocation. Valid while that storage lives at that address."""

    def __init__(self, storage: Any, handle: Optional[bytes], size: int, offset: int) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._storage = StorageWeakRef(storage)  # held weakly, as _Held
        self._ptr = storage.data_ptr()
        self._nbytes = storage.nbytes()
        self.handle = handle
        self.size = size
        self.offset = offset

    def alive(self) -> bool:
        return not self._storage.expired()

    def of(self, storage: Any) -> bool:
        """True if this is still the share of `storage`."""
        return self.alive() and self._ptr == storage.data_ptr() and self._nbytes == storage.nbytes()


def _release_ipc_counter(counter: Tuple[bytes, int]) -> None:
    """Gives back the reference torch counted for a receiver when it shared a
    storage (``_share_cuda_()[4:6]``: the counters file and the slot in it),
    as a receiving torch process does when it lets go of the storage."""
    import torch

    torch.UntypedStorage._release_ipc_counter_cuda(*counter)


def _cuda_allocation(
    src: _tensors.Source, share: Callable[[Any], CudaShare]
) -> Optional[Tuple[bytes, bytes, int, int, int]]:
    """(IPC handle, GPU UUID, device index, byte offset of the tensor in the
    allocation, end of its storage there) for a CUDA torch tensor, else None
    (also when the allocator hands out no plain IPC handle, as with
    expandable segments). `share(storage)` shares the tensor's storage."""
    t = src.tensor
    if t is None or t.device.type != "cuda":
        return None
    import torch

    storage = t.untyped_storage()
    try:
        shared = share(storage)
    except (RuntimeError, AttributeError):
        return None
    if shared.handle is None:
        return None
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    uuid = bytes(torch.cuda.get_device_properties(index).uuid.bytes)
    offset = shared.offset + (t.data_ptr() - storage.data_ptr())
    return shared.handle, uuid, index, offset, shared.offset + shared.size


class _ArenaMap(mmap.mmap):
    """A mapping that keeps its shared_tensors() arena alive: every tensor
    over the arena's memory holds the mapping (through the array its bytes
    came from), and so the arena and its registration."""

    arena: Any = None


def _allocate(fd: int, size: int) -> None:
    """Allocates every page of the memfd now, on this process' account.

    The daemon of a GPU store page-locks a region when it is registered,
    which is before the client writes its staging; it declines a region with
    pages nobody wrote (page-locking would allocate them on the daemon's
    account), and its refits then copy through a bounce buffer instead of
    reading the region by DMA. The memory is the same as the first writes
    would take, taken at once (a shm-lane push of 1 GiB of private tensors
    made its first copy ~20% faster this way)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return  # the pages come with the first writes, as they would anyway
        raise MemoryError(
            f"refit_client: cannot allocate {size} bytes of shared memory (a memfd): {e.strerror}"
        ) from e


class Staging:
    """The client's sealed memfd staging region."""

    def __init__(self, size: int, map_type: Any = mmap.mmap) -> None:
        self.size = size
        self.fd = os.memfd_create("refit-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            _allocate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self.map = map_type(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = np.frombuffer(self.map, dtype=np.uint8)

    def close(self) -> None:
        del self.view
        try:
            self.map.close()
        except BufferError:
            pass  # a view is still alive somewhere: the mapping goes with it
        os.close(self.fd)


class _Arena:
    """The sealed memfd behind shared_tensors()' tensors, kept alive by them
    and by anything sharing their memory (views, nn.Parameters made from
    them, tensors swapped in with .data or load_state_dict(assign=True))."""

    def __init__(self, size: int) -> None:
        import torch

        self.staging = Staging(max(size, 1), map_type=_ArenaMap)
        self.staging.map.arena = self
        # from_numpy: the tensor's storage holds the array, which holds the
        # mapping's buffer, so the mapping cannot be closed under it.
        # (torch.frombuffer keeps the mapping object but releases its
        # buffer: closing it would unmap memory the tensors still point to.)
        self.bytes = torch.from_numpy(self.staging.view)
        self.base = self.bytes.data_ptr()
        self.size = self.staging.size

    def __del__(self) -> None:
        try:
            del self.bytes
            self.staging.close()
        except Exception:
            pass


_ARENAS: "weakref.WeakSet[_Arena]" = weakref.WeakSet()
_ARENAS_LOCK = threading.Lock()


def shared_tensors(
    tensors: Union[Mapping[str, Any], Iterable[Tuple[str, Any]]]
) -> Dict[str, Any]:
    """Copies torch tensors (a state_dict) once into one memfd sealed against
    shrinking and returns CPU tensors of the same names, dtypes and shapes
    that view it (contiguous, 256-byte aligned). push(..., lane="shm") sends
    such tensors with no copy: the client registers the memfd once and
    refitd maps it and ingests straight from it. Keep a trainer's weights
    there (``shared[name].copy_(param)`` after each step, or train them in
    place) and every push is copy-free on the trainer's side. The memory
    lives as long as any of the returned tensors (or a view of them)."""
    import torch

    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    total = sum(_aligned(t.numel() * t.element_size()) for _, t in items)
    arena = _Arena(total)
    out: Dict[str, Any] = {}
    offset = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        view = arena.bytes[offset : offset + n].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        out[name] = view
        offset += _aligned(n)
    with _ARENAS_LOCK:
        _ARENAS.add(arena)
    return out


def _live_arenas() -> List[_Arena]:
    with _ARENAS_LOCK:
        return list(_ARENAS)


def _arena_of(
    src: _tensors.Source, arenas: Optional[List[_Arena]] = None
) -> Optional[Tuple[_Arena, int]]:
    """The shared_tensors() arena holding the tensor, and its offset there
    (among `arenas`, default: every live one)."""
    t = src.tensor
    if t is None or t.device.type != "cpu":
        return None
    ptr = t.data_ptr()
    for arena in _live_arenas() if arenas is None else arenas:
        if arena.base <= ptr and ptr + src.nbytes <= arena.base + arena.size:
            return arena, ptr - arena.base
    return None


class _Held:
    """What a cached registration was made for, held weakly: a registration
    must not keep a trainer's dropped shared memory alive. A storage is
    known by its address and size while it lives; an arena while it lives."""

    def __init__(self, owner: Any) -> None:
        self.ptr: Optional[int] = None
        self.nbytes = 0
        if isinstance(owner, _Arena):
            self._arena: Optional["weakref.ref[_Arena]"] = weakref.ref(owner)
            self._storage: Any = None
        else:
            from torch.multiprocessing.reductions import StorageWeakRef

            self._arena = None
            self._storage = StorageWeakRef(owner)
            self.ptr = owner.data_ptr()
            self.nbytes = owner.nbytes()

    def alive(self) -> bool:
        if self._arena is not None:
            return self._arena() is not None
        return not self._storage.expired()


class ShmLane:
    """A client's registered regions (thread-safe; one push at a time uses
    the staging region, which push() ensures by holding the lock)."""

    def __init__(
        self, channel: grpc.Channel, metadata: Any, address: str, cuda_ipc: bool = True
    ) -> None:
        self._stub = rpb_grpc.RegionServiceStub(channel)
        self._cuda_ipc = cuda_ipc
        # Why CUDA tensors last went through host staging instead, or None.
        self.cuda_ipc_fallback_reason: Optional[str] = None
        # The CUDA allocations registered for the push in progress.
        self._cuda_leases: List[Lease] = []
        # CUDA storages torch has shared, by storage (its _cdata, which a
        # storage held weakly keeps from being reused), each shared once
        # while it lives.
        self._cuda_shares: Dict[int, CudaShare] = {}
        # The receiver references the shares of the push in progress counted:
        # given back when it ends (end_push).
        self._ipc_counters: List[Tuple[bytes, int]] = []
        self._metadata = metadata
        self._address = address
        self.lock = threading.Lock()
        self._shared: "collections.OrderedDict[Tuple[int, int], Tuple[Lease, _Held]]" = (
            collections.OrderedDict()
        )
        # The cached storages the push being planned uses (never evicted for it).
        self._push_keys: Set[Tuple[int, int]] = set()
        # A shared storage's address -> its key in _shared, so that a storage
        # pushed again needs neither its descriptor nor an fstat. Trusted only
        # while the storage cached under that key still has that address: it
        # is held there, so no other storage can have been given it.
        self._storage_keys: Dict[int, Tuple[int, int]] = {}
        self._staging: Optional[Staging] = None
        self._staging_lease: Optional[Lease] = None
        # Bytes copied into the staging region by the last push (0: every
        # tensor went from the trainer's own shared memory).
        self.last_copied_bytes = 0
        # Region chunks encoded by past pushes (Refit._send_region), for
        # the next push of the same tensors at the same places.
        self.chunk_cache: Dict[Any, List[Tuple[bytes, int]]] = {}

    def regions(self) -> List[Lease]:
        out = [lease for lease, _ in self._shared.values()]
        if self._staging_lease is not None:
            out.append(self._staging_lease)
        return out

    def _known_storage(self, src: _tensors.Source) -> Optional[Tuple[Lease, int]]:
        """(lease, byte offset of the tensor in it) for a CPU tensor whose
        shared storage this client registered and still holds, else None."""
        t = src.tensor
        if t is None or t.device.type != "cpu":
            return None
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        key = self._storage_keys.get(ptr) if ptr else None
        if key is None:
            return None
        hit = self._shared.get(key)
        if (
            hit is None
            or hit[1].ptr != ptr
            or hit[1].nbytes != storage.nbytes()
            or not hit[1].alive()
            or not hit[0].alive()
        ):
            del self._storage_keys[ptr]
            return None
        self._shared.move_to_end(key)
        self._push_keys.add(key)
        return hit[0], t.data_ptr() - ptr

    def _shared_lease(self, storage: Any, fd: int, size: int) -> Lease:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        hit = self._shared.get(key)
        if hit is not None and hit[0].size >= size and hit[0].alive():
            self._shared.move_to_end(key)
            self._push_keys.add(key)
            return hit[0]
        if hit is not None:
            hit[0].release()
            self._forget(hit[1])
        try:
            lease = self._with_room(
                lambda: register(
                    self._stub, self._metadata, fd, size, "shared storage", self._address
                )
            )
        except ResourceExhausted as e:
            raise ResourceExhausted(
                f"{e.message}; this push's tensors are in {len(self._push_keys) + 1} "
                "or more shared storages, each its own region: put them in one with "
                "refit_client.shared_tensors(), or raise the daemon's limit"
            ) from None
        # The inode (the key) cannot be reused while the daemon holds the
        # region's descriptor; the storage itself is held weakly.
        held = _Held(storage)
        self._shared[key] = (lease, held)
        if held.ptr is not None:
            self._storage_keys[held.ptr] = key
        self._push_keys.add(key)
        if len(self._shared) > MAX_CACHED_REGIONS:
            self._evict(len(self._shared) - MAX_CACHED_REGIONS)
        return self._shared[key][0]

    def _forget(self, held: _Held) -> None:
        # (A storage now at that address found no key: it is looked up by
        # its descriptor instead.)
        if held.ptr is not None:
            self._storage_keys.pop(held.ptr, None)

    def _drop_dead(self) -> None:
        """Ends the registrations of shared memory the trainer has dropped
        (the daemon then unmaps it and closes its descriptor)."""
        for key in [k for k, (_, held) in self._shared.items() if not held.alive()]:
            lease, held = self._shared.pop(key)
            self._forget(held)
            lease.release()

    def _with_room(self, register_once: Callable[[], Lease]) -> Lease:
        """register_once(), making room while the daemon refuses it over its
        per-caller limits; ResourceExhausted once nothing is left to drop."""
        while True:
            try:
                return register_once()
            except ResourceExhausted:
                if self._evict(_EVICT_BATCH) == 0:
                    raise

    def _evict(self, count: int) -> int:
        """Unregisters up to `count` cached shared storages, least recently
        used first, that the push in progress has not used; returns how many.
        UnregisterRegion is answered once the daemon has dropped the region,
        so the room is there for the next registration."""
        victims = [k for k in self._shared if k not in self._push_keys][:count]
        for key in victims:
            lease, held = self._shared.pop(key)
            self._forget(held)
            try:
                self._stub.UnregisterRegion(
                    rpb.UnregisterRegionRequest(region_id=lease.region_id),
                    metadata=self._metadata,
                    timeout=_FD_SOCKET_TIMEOUT,
                )
            except grpc.RpcError:
                pass  # gone already; cancelling the lease below releases it anyway
            lease.release()
        return len(victims)

    def plan(
        self, sources: List[_tensors.Source], staging_limit: Optional[int] = None
    ) -> List[Tuple[_tensors.Source, Lease, int, bool]]:
        """Each tensor's region and offset, and whether it must be copied
        into the staging region first. Registers what is new. With
        `staging_limit`, a push that would need a larger staging region is
        ResourceExhausted before anything is registered."""
        self._push_keys = set()
        self._drop_dead()
        cuda = self._plan_cuda(sources)
        # Looked up once per push: a model has hundreds of tensors, most in
        # one arena.
        arenas = _live_arenas()
        # Where each tensor is, before anything is registered: (lease or
        # None, offset, what registers it or None, copy).
        found: List[Tuple[Optional[Lease], int, Any, bool]] = []
        need = 0
        for i, src in enumerate(sources):
            if i in cuda:
                found.append((cuda[i][0], cuda[i][1], None, False))
                continue
            in_arena = _arena_of(src, arenas)
            if in_arena is not None:
                found.append((None, in_arena[1], in_arena[0], False))
                continue
            known = self._known_storage(src)
            if known is not None:
                found.append((known[0], known[1], None, False))
                continue
            shared = _shared_storage(src)
            if shared is not None:
                found.append((None, shared[2], shared, False))
                continue
            found.append((None, need, None, True))
            # At least one unit, so that a push of only empty private
            # tensors has a staging region to reference too.
            need += _aligned(max(src.nbytes, 1))
        if staging_limit is not None and need > staging_limit:
            self.end_push()
            raise ResourceExhausted(
                f"the shared-memory lane would copy {need} bytes into its staging region, "
                f"more than shm_staging_limit {staging_limit}"
            )
        arena_leases: Dict[int, Lease] = {}
        placed: List[Tuple[_tensors.Source, Optional[Lease], int, bool]] = []
        for src, (lease, offset, owner, copy) in zip(sources, found):
            if isinstance(owner, _Arena):
                lease = arena_leases.get(id(owner))
                if lease is None:
                    lease = self._shared_lease(owner, owner.staging.fd, owner.size)
                    arena_leases[id(owner)] = lease
            elif owner is not None:
                storage, fd, _, size = owner
                lease = self._shared_lease(storage, fd, size)
            placed.append((src, lease, offset, copy))
        if need > 0:
            self._ensure_staging(need)
        out = []
        for src, lease, offset, copy in placed:
            out.append((src, lease if lease is not None else self._staging_lease, offset, copy))
        return out

    def _plan_cuda(self, sources: List[_tensors.Source]) -> Dict[int, Tuple[Lease, int]]:
        """Registers the CUDA allocations holding CUDA tensors (one lease
        each, for this push) and synchronizes their devices; source index ->
        (lease, offset). Empty when the lane is off or the daemon refused
        (then cuda_ipc_fallback_reason says why and the tensors are copied)."""
        if not self._cuda_ipc:
            return {}
        self._cuda_shares = {k: v for k, v in self._cuda_shares.items() if v.alive()}
        found: Dict[int, Tuple[bytes, int]] = {}
        allocations: Dict[bytes, Tuple[bytes, int]] = {}  # handle -> (uuid, bytes needed)
        devices = set()
        for i, src in enumerate(sources):
            alloc = _cuda_allocation(src, self._share_cuda)
            if alloc is None:
                if src.tensor is not None and src.tensor.device.type == "cuda":
                    self.cuda_ipc_fallback_reason = (
                        f"tensor {src.name!r}: its CUDA allocation has no cudaIpcMemHandle "
                        "(expandable segments?); CUDA tensors without one are copied"
                    )
                continue
            handle, uuid, index, offset, end = alloc
            found[i] = (handle, offset)
            devices.add(index)
            prev = allocations.get(handle)
            allocations[handle] = (uuid, max(end, prev[1] if prev else 0))
        if not found:
            return {}
        import torch

        # The daemon reads what the trainer's streams wrote: wait for them.
        for index in devices:
            torch.cuda.synchronize(index)
        leases: Dict[bytes, Lease] = {}
        try:
            for handle, (uuid, size) in allocations.items():
                try:
                    lease = self._with_room(
                        lambda: register_cuda(
                            self._stub, self._metadata, handle, uuid, size, "cuda tensors",
                            self._address,
                        )
                    )
                except ResourceExhausted as e:
                    # Nothing left to drop: copy them this time.
                    self.end_push()
                    self.cuda_ipc_fallback_reason = str(e)
                    return {}
                self._cuda_leases.append(lease)
                leases[handle] = lease
        except RefitError as e:
            self.end_push()
            self.cuda_ipc_fallback_reason = str(e)
            self._cuda_ipc = False  # this daemon cannot open them: copy from now on
            return {}
        return {i: (leases[handle], offset) for i, (handle, offset) in found.items()}

    def _share_cuda(self, storage: Any) -> CudaShare:
        """The share of a CUDA storage: torch's _share_cuda_() the first time
        the storage is seen, the same answer while it lives. Raises what
        torch raises (RuntimeError)."""
        key = storage._cdata
        known = self._cuda_shares.get(key)
        if known is not None and known.of(storage):
            return known
        shared = storage._share_cuda_()
        # (device, handle, storage bytes, offset in the allocation, receiver
        # reference: counters file and slot, event handle, event needed)
        if shared[4] is not None:
            self._ipc_counters.append((shared[4], int(shared[5])))
        share = CudaShare(storage, cuda_ipc_mem_handle(shared[1]), int(shared[2]), int(shared[3]))
        self._cuda_shares[key] = share
        return share

    def end_push(self) -> None:
        """Releases the CUDA allocations registered for the push, and gives
        back the receiver references its shares counted: the daemon has let
        go of them (or never opened them), and a storage freed while counted
        would keep its memory for good."""
        for lease in self._cuda_leases:
            lease.release()
        self._cuda_leases = []
        counters, self._ipc_counters = self._ipc_counters, []
        for counter in counters:
            try:
                _release_ipc_counter(counter)
            except RuntimeError:
                pass  # torch already gave up on its counters file (it warned)

    def drop_truncated(self, message: str) -> None:
        """Ends the registrations a daemon's error says were truncated while
        it read them: it refuses every later chunk that names such a region
        ("register it again"), so the next push registers the memory anew."""
        ids = set(_TRUNCATED.findall(message))
        if not ids:
            return
        for key in [k for k, (lease, _) in self._shared.items() if lease.region_id in ids]:
            lease, held = self._shared.pop(key)
            self._forget(held)
            lease.release()
        if self._staging_lease is not None and self._staging_lease.region_id in ids:
            self.drop_staging()

    def _ensure_staging(self, size: int) -> None:
        if (
            self._staging is not None
            and self._staging.size >= size
            and self._staging_lease is not None
            and self._staging_lease.alive()
        ):
            return
        self.drop_staging()
        staging = Staging(size)
        try:
            self._staging_lease = self._with_room(
                lambda: register(
                    self._stub, self._metadata, staging.fd, size, "staging", self._address
                )
            )
        except BaseException:
            staging.close()
            raise
        self._staging = staging

    def copy(self, src: _tensors.Source, offset: int) -> None:
        assert self._staging is not None and src.copy_into is not None
        src.copy_into(self._staging.view[offset : offset + src.nbytes])

    def drop_staging(self) -> None:
        if self._staging_lease is not None:
            self._staging_lease.release()
            self._staging_lease = None
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def close(self) -> None:
        self.end_push()
        self._cuda_shares.clear()
        for lease, _ in self._shared.values():
            lease.release()
        self._shared.clear()
        self._storage_keys.clear()
        self.drop_staging()
