"""Turns what push() accepts into tensors it can stream: name, dtype, full
shape, and a way to read byte ranges without copying the whole tensor.

torch is imported only when a torch tensor is seen (or read(as_="torch")).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, Mapping, Optional, Tuple, Union

import numpy as np

from .errors import InvalidArgument

# Threads that copy one tensor into the shared-memory lane's staging: one
# thread's memcpy is a fraction of a server's memory bandwidth, and the copy
# is what the daemon waits for. A quarter of the cores, at most 4 (the
# daemon on the same host needs the rest); 1 on small machines.
COPY_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))
_COPY_PIECE = 1 << 20  # no thread copies less
_MAX_COPY_THREADS = 8
_copy_pool: Any = None
_copy_pool_lock = threading.Lock()

try:
    # Streaming stores for the staging copy (_ntcopy.c says why); built
    # with the package where a C compiler was found.
    from ._ntcopy import copy as _copy_bytes

    STREAMING_COPY = True
except ImportError:
    _copy_bytes = np.copyto
    STREAMING_COPY = False


def parallel_copyto(dst: np.ndarray, src: np.ndarray, threads: Optional[int] = None) -> None:
    """Copies a 1-D uint8 array into another of its size, split over up to
    `threads` (default COPY_THREADS, at most 8) threads: this one and a
    shared pool's. Each piece goes with streaming stores where _ntcopy was
    built, with np.copyto otherwise (both release the GIL while they copy)."""
    threads = COPY_THREADS if threads is None else threads
    n = src.shape[0]
    parts = max(1, min(threads, _MAX_COPY_THREADS, n // _COPY_PIECE))
    if parts == 1:
        _copy_bytes(dst, src)
        return
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _copy_pool = ThreadPoolExecutor(
                max_workers=_MAX_COPY_THREADS - 1, thread_name_prefix="refit-copy"
            )
        pool = _copy_pool
    bounds = [n * i // parts for i in range(parts + 1)]
    futures = [pool.submit(_copy_bytes, dst[bounds[i]:bounds[i + 1]], src[bounds[i]:bounds[i + 1]])
               for i in range(1, parts)]
    _copy_bytes(dst[: bounds[1]], src[: bounds[1]])
    for f in futures:
        f.result()

# dtype name -> (proto DType value, bytes per element). Values match
# refit.v1.DType; _client checks them against the generated enum.
DTYPE_BF16 = "bf16"
DTYPE_FP16 = "fp16"
DTYPE_FP32 = "fp32"
PUSH_DTYPES = {DTYPE_FP32: 1, DTYPE_FP16: 2, DTYPE_BF16: 3}
ITEMSIZE = {DTYPE_FP32: 4, DTYPE_FP16: 2, DTYPE_BF16: 2}
_ALIASES = {
    "bf16": DTYPE_BF16,
    "bfloat16": DTYPE_BF16,
    "fp16": DTYPE_FP16,
    "f16": DTYPE_FP16,
    "float16": DTYPE_FP16,
    "half": DTYPE_FP16,
    "fp32": DTYPE_FP32,
    "f32": DTYPE_FP32,
    "float32": DTYPE_FP32,
    "float": DTYPE_FP32,
}


def dtype_name(dtype: Any) -> str:
    """Normalizes "bf16" / "bfloat16" / torch.bfloat16 / np.float16 ... to
    "bf16", "fp16" or "fp32"."""
    text = str(dtype).lower()
    for prefix in ("torch.", "numpy.", "<class 'numpy.", "dtype('"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    text = text.rstrip("')>")
    if text not in _ALIASES:
        raise InvalidArgument(f"unsupported dtype {dtype!r}: push takes bf16, fp16 or fp32")
    return _ALIASES[text]


@dataclasses.dataclass(frozen=True)
class TensorData:
    """An array with an explicit refit dtype, e.g. bf16 bits held in a uint16
    numpy array. Build it with bf16() or pass (name, array, "bf16")."""

    data: Any
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))


def bf16(array: Any) -> TensorData:
    """Marks a numpy array as bf16: uint16/int16 arrays are taken as raw bf16
    bits; float32/float64 arrays are rounded to bf16 (round to nearest even,
    as torch does)."""
    arr = np.asarray(array)
    if arr.dtype.kind == "f" and arr.dtype.name != "bfloat16":
        arr = float32_to_bf16_bits(arr.astype(np.float32, copy=False))
    return TensorData(arr, DTYPE_BF16)


def float32_to_bf16_bits(arr: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(arr)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


@dataclasses.dataclass
class Source:
    """One tensor ready to stream: ``read(offset, n)`` returns n bytes from
    byte ``offset`` of its row-major contents (copying only that range to the
    host, for a CUDA tensor)."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    nbytes: int
    read: Callable[[int, int], bytes]
    # The shared-memory lane (_shm.py): copies the whole tensor into a uint8
    # numpy view of a region, and the flat torch tensor itself, whose
    # storage may already be in shared memory.
    copy_into: Optional[Callable[[np.ndarray], None]] = None
    tensor: Any = None

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


def _torch_module() -> Any:
    return sys.modules.get("torch")


def _is_torch_tensor(value: Any) -> bool:
    torch = _torch_module()
    return torch is not None and isinstance(value, torch.Tensor)


_TORCH_DTYPES = {DTYPE_BF16: "bfloat16", DTYPE_FP16: "float16", DTYPE_FP32: "float32"}


# torch dtype -> its refit dtype name (dtype_name's string work, once per
# dtype rather than once per tensor of a model's hundreds).
_TORCH_DTYPE_NAMES: Dict[Any, str] = {}


def _from_torch(name: str, tensor: Any, dtype: Optional[str]) -> Source:
    torch = _torch_module()
    t = tensor.detach()
    if dtype is None:
        dtype = _TORCH_DTYPE_NAMES.get(t.dtype)
    if dtype is None:
        try:
            dtype = dtype_name(t.dtype)
        except InvalidArgument:
            raise InvalidArgument(
                f"tensor '{name}': torch dtype {t.dtype} cannot be pushed (bf16, fp16, fp32)"
            ) from None
        _TORCH_DTYPE_NAMES[t.dtype] = dtype
    want = getattr(torch, _TORCH_DTYPES[dtype])
    if t.dtype != want:
        if not t.is_floating_point():
            raise InvalidArgument(f"tensor '{name}': torch dtype {t.dtype} is not floating point")
        t = t.to(want)
    # A non-contiguous view is copied once, this tensor only (on its device).
    flat = t.contiguous().reshape(-1)
    itemsize = ITEMSIZE[dtype]

    def read(offset: int, n: int) -> bytes:
        part = flat[offset // itemsize : (offset + n) // itemsize]
        if part.device.type != "cpu":
            part = part.to("cpu")
        return part.view(torch.uint8).numpy().tobytes()

    def copy_into(dst: np.ndarray) -> None:
        if flat.device.type == "cpu":
            # Plain memcpys on a few threads (parallel_copyto): torch's
            # copy_ would spread it over all its intra-op threads, which
            # then spin (CPU time the daemon, on the same host, could have
            # used).
            parallel_copyto(dst, flat.view(torch.uint8).numpy())
        else:
            torch.from_numpy(dst).copy_(flat.view(torch.uint8))

    return Source(
        name,
        dtype,
        tuple(t.shape),
        flat.numel() * itemsize,
        read,
        copy_into=copy_into,
        tensor=flat,
    )


def _numpy_dtype(name: str, arr: np.ndarray, dtype: Optional[str]) -> Tuple[np.ndarray, str]:
    if arr.dtype.name == "bfloat16":  # ml_dtypes / jax bfloat16
        if dtype not in (None, DTYPE_BF16):
            raise InvalidArgument(f"tensor '{name}': bfloat16 array given as {dtype}")
        return arr.view(np.uint16), DTYPE_BF16
    if dtype is None:
        if arr.dtype == np.float32:
            return arr, DTYPE_FP32
        if arr.dtype == np.float16:
            return arr, DTYPE_FP16
        hint = " (bf16 bits? pass (name, array, 'bf16') or refit_client.bf16(array))" if (
            arr.dtype in (np.uint16, np.int16)) else ""
        raise InvalidArgument(
            f"tensor '{name}': numpy dtype {arr.dtype} cannot be pushed as is{hint}")
    if dtype == DTYPE_BF16:
        if arr.dtype in (np.uint16, np.int16):
            return arr, DTYPE_BF16
        if arr.dtype.kind == "f":
            return float32_to_bf16_bits(arr.astype(np.float32, copy=False)), DTYPE_BF16
    elif arr.dtype.kind == "f":
        return arr.astype(np.float16 if dtype == DTYPE_FP16 else np.float32, copy=False), dtype
    raise InvalidArgument(f"tensor '{name}': numpy dtype {arr.dtype} cannot be pushed as {dtype}")


def _from_numpy(name: str, value: Any, dtype: Optional[str]) -> Source:
    arr, dtype = _numpy_dtype(name, np.asarray(value), dtype)
    shape = tuple(int(d) for d in arr.shape)
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)

    def read(offset: int, n: int) -> bytes:
        return flat[offset : offset + n].tobytes()

    def copy_into(dst: np.ndarray) -> None:
        parallel_copyto(dst, flat)

    return Source(name, dtype, shape, int(flat.size), read, copy_into=copy_into)


def to_source(name: Any, value: Any, dtype: Any = None) -> Source:
    """One tensor (torch, numpy, TensorData) as a Source."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"tensor names must be non-empty strings, got {name!r}")
    want = dtype_name(dtype) if dtype is not None else None
    if isinstance(value, TensorData):
        if want is not None and want != value.dtype:
            raise InvalidArgument(f"tensor '{name}': marked {value.dtype} but pushed as {want}")
        want, value = value.dtype, value.data
    if _is_torch_tensor(value):
        return _from_torch(name, value, want)
    if isinstance(value, np.ndarray) or hasattr(value, "__array__"):
        return _from_numpy(name, value, want)
    raise InvalidArgument(
        f"tensor '{name}': {type(value).__name__} is not a torch tensor or a numpy array")


TensorsArg = Union[Mapping[str, Any], Iterable[Tuple[Any, ...]]]


def iter_sources(tensors: TensorsArg) -> Iterator[Source]:
    """Yields a Source per entry, lazily: a mapping (a state_dict) or an
    iterable of (name, tensor) / (name, tensor, dtype)."""
    items: Iterable[Any] = tensors.items() if isinstance(tensors, Mapping) else tensors
    for item in items:
        if not isinstance(item, tuple) or len(item) not in (2, 3):
            raise InvalidArgument(
                f"push takes a mapping or (name, tensor[, dtype]) tuples, got {type(item).__name__}")
        yield to_source(*item)


def count(tensors: TensorsArg) -> Optional[int]:
    try:
        return len(tensors)  # type: ignore[arg-type]
    except TypeError:
        return None
