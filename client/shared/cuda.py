"""Thin, checked wrappers over the CUDA calls engramd needs (through cuda-python).

One checker turns cuda-python's `(err, *values)` tuples into values or a CudaError naming the call.
The rest are the few operations both sides of the GPU data path share: device UUIDs (processes see
different device indices under CUDA_VISIBLE_DEVICES, UUIDs are the same), device memory shared
as file descriptors, stream memory operations on 32-bit counters, and viewing raw device memory as a torch tensor.
Imported only where CUDA is used; nothing here runs at import time, and torch is imported only
by the calls that make tensors or streams (host_pin.py pins tables before torch is loaded).
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from engramd.client.errors import CudaUnavailableError

if TYPE_CHECKING:
    import torch

try:
    from cuda.bindings import driver as cu
    from cuda.bindings import runtime as cudart
except ImportError:  # pragma: no cover - cuda-python is a dependency; keep the message clear
    cu = cudart = None

class CudaError(RuntimeError):
    """A CUDA call failed; the message names the call and the error."""


def require_cuda_python() -> None:
    if cudart is None:
        raise CudaError("cuda-python is not installed (pip install cuda-python)")


def check(call: str, result: Any) -> Any:
    """`(err, *values)` -> values (None, one value, or a tuple); raises CudaError on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    code = int(err)
    if code != 0:
        name = _error_name(err)
        raise CudaError(f"{call} failed: {name} ({code})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _error_name(err: Any) -> str:
    try:
        if isinstance(err, cu.CUresult):
            _, text = cu.cuGetErrorName(err)
        else:
            _, text = cudart.cudaGetErrorName(err)
        return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:
        return str(err)


CUDA_ERROR_NO_DEVICE = 100  # cuInit's answer on a machine with a driver but no GPU visible


def require_device(index: int | None) -> None:
    """CudaUnavailableError unless the driver sees device `index` (None: any device). Without
    it, a machine with no driver fails deep in cuda-python, with cuda.pathfinder's
    DynamicLibNotFoundError from the first call, after the client has already registered."""
    name = "cuda" if index is None else f"cuda:{index}"
    if cu is None:
        raise CudaUnavailableError(f"device {name!r}: cuda-python is not installed "
                                   "(pip install cuda-python); device='cpu' needs no GPU")
    try:
        err, *_ = cu.cuInit(0)
    except Exception as exc:  # cuda.pathfinder's DynamicLibNotFoundError: no libcuda here
        raise CudaUnavailableError(
            f"device {name!r}: no CUDA driver on this machine (the NVIDIA driver library "
            f"libcuda cannot be loaded: {type(exc).__name__}); use device='cpu', which needs "
            "no GPU") from None
    if int(err) == CUDA_ERROR_NO_DEVICE:
        raise CudaUnavailableError(f"device {name!r}: the CUDA driver sees no GPU in this "
                                   "process (CUDA_VISIBLE_DEVICES, the container's GPUs?); use "
                                   "device='cpu'")
    if int(err) != 0:
        raise CudaUnavailableError(f"device {name!r}: cuInit failed: {_error_name(err)} "
                                   f"({int(err)}); use device='cpu' where CUDA cannot start")
    count = check("cuDeviceGetCount", cu.cuDeviceGetCount())
    if index is not None and not 0 <= index < count:
        raise CudaUnavailableError(f"device {name!r}: this process sees {count} GPU(s), "
                                   f"cuda:0 to cuda:{count - 1}")


def device_uuid(index: int) -> str:
    """The nvidia-smi style UUID ("GPU-xxxxxxxx-xxxx-...") of this process's device `index`."""
    require_cuda_python()
    check("cuInit", cu.cuInit(0))
    dev = check("cuDeviceGet", cu.cuDeviceGet(index))
    raw = bytes(check("cuDeviceGetUuid", cu.cuDeviceGetUuid(dev)).bytes)
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class DeviceAllocation:
    """Device memory from CUDA's virtual memory API, shareable as a POSIX file descriptor.

    The daemon creates one per served client's slab and passes its descriptor over the handle
    socket; the client imports it. Each side maps the physical allocation at an address of its
    own and lets go of it with close(); the memory is freed when the last holder has let go, so
    a client that is slow to let go never reads freed memory. Unlike legacy CUDA IPC handles,
    a descriptor needs no shared IPC or PID namespace.
    """

    def __init__(self, handle: Any, size: int, device_index: int):
        self.size = size
        self.device_index = device_index
        self._handle = handle
        self.ptr = 0
        self._mapped = False
        try:
            with on_device(device_index):
                self.ptr = int(check("cuMemAddressReserve",
                                     cu.cuMemAddressReserve(size, _granularity(device_index), 0, 0)))
                self._map()
        except BaseException:
            self.close()
            raise

    def _map(self) -> None:
        check("cuMemMap", cu.cuMemMap(self.ptr, self.size, 0, self._handle, 0))
        self._mapped = True
        access = cu.CUmemAccessDesc()
        access.location = _device_location(self.device_index)
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        check("cuMemSetAccess", cu.cuMemSetAccess(self.ptr, self.size, [access], 1))

    @classmethod
    def create(cls, device_index: int, size: int) -> DeviceAllocation:
        """`size` bytes (rounded up to the allocation granularity) on device `device_index`."""
        require_cuda_python()
        with on_device(device_index):
            granularity = _granularity(device_index)
            size = (size + granularity - 1) // granularity * granularity
            handle = check("cuMemCreate", cu.cuMemCreate(size, _allocation_prop(device_index), 0))
        return cls(handle, size, device_index)

    @classmethod
    def from_descriptor(cls, fd: int, size: int, device_index: int) -> DeviceAllocation:
        """Import a peer's allocation of `size` bytes; the caller still owns (and closes) `fd`."""
        require_cuda_python()
        with on_device(device_index):
            handle = check("cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(
                fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return cls(handle, size, device_index)

    def descriptor(self) -> int:
        """A new POSIX descriptor of the allocation (the caller closes it)."""
        return int(check("cuMemExportToShareableHandle", cu.cuMemExportToShareableHandle(
            self._handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))

    def replace_from_descriptor(self, fd: int) -> None:
        """Map a peer's allocation of the same size at this address instead of the one mapped
        here, and let go of that one (the device must be done with it). Tensors over the address
        then read the new memory; `fd` stays the caller's."""
        with on_device(self.device_index):
            handle = check("cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(
                fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
            try:
                self._unmap_and_release()
            except BaseException:
                check("cuMemRelease", cu.cuMemRelease(handle))  # the new one is not ours to keep
                raise
            self._handle = handle  # close() releases it from here on, mapped or not
            self._map()

    def close(self) -> None:
        """Unmap and release this process's hold (the device must be done with the memory)."""
        with on_device(self.device_index):
            self._unmap_and_release()
            ptr, self.ptr = self.ptr, 0
            if ptr:
                check("cuMemAddressFree", cu.cuMemAddressFree(ptr, self.size))

    def _unmap_and_release(self) -> None:
        mapped, handle, self._mapped, self._handle = self._mapped, self._handle, False, None
        if mapped:
            check("cuMemUnmap", cu.cuMemUnmap(self.ptr, self.size))
        if handle is not None:
            check("cuMemRelease", cu.cuMemRelease(handle))


@contextmanager
def on_device(device_index: int) -> Iterator[None]:
    """The device's primary context current in this thread (make_current) for the block; after
    it, the thread's device as it was, where that device has a context (torch.cuda.device's
    rule: no context is made on a device only to go back to it). A thread that launches work
    after making slabs for several GPUs still sets its device first (the daemon's inline
    submit does)."""
    import torch

    with torch.cuda.device(device_index):  # restores the thread's device on the way out
        make_current(device_index)
        yield


def enter_thread(device_index: int) -> None:
    """The first call of each thread of engramd's own that touches CUDA (the cache keeper, the
    heartbeat, the captured lookup's upkeep, remapping, unmapping, registering): the device's
    context current (make_current), and the thread's calls let through while an engine captures
    a CUDA graph in CUDA's default (global) mode, which vLLM's and SGLang's captures use. There,
    a potentially unsafe call (an allocation, a stream's synchronize) from any other thread in
    the default mode is refused and spoils the capture. Relaxed mode lets those through, which
    is sound where the calls touch no stream being captured; a synchronize of the whole device
    (the client's when its tables go away) still conflicts with any capture in progress."""
    make_current(device_index)
    relaxed = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed
    check("cudaThreadExchangeStreamCaptureMode", cudart.cudaThreadExchangeStreamCaptureMode(relaxed))


def make_current(device_index: int) -> None:
    """Make the device's primary context current in this thread, for driver API calls.

    torch.cuda.device() alone does not in a fresh thread (it skips cudaSetDevice when the index
    is already the thread's default), and driver calls then fail with INVALID_CONTEXT.
    cudaSetDevice initialises the primary context and, unlike cudaFree(0), never synchronises.
    """
    check("cudaSetDevice", cudart.cudaSetDevice(device_index))


def _device_location(device_index: int) -> Any:
    location = cu.CUmemLocation()
    location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    location.id = int(check("cuDeviceGet", cu.cuDeviceGet(device_index)))
    return location


def _allocation_prop(device_index: int) -> Any:
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = _device_location(device_index)
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _granularity(device_index: int) -> int:
    return int(check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(
        _allocation_prop(device_index),
        cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))


def stream_write_u32(stream: int, address: int, value: int) -> None:
    """Enqueue `*address = value` on `stream` (ordered after the stream's earlier work)."""
    check("cuStreamWriteValue32", cu.cuStreamWriteValue32(
        cu.CUstream(stream), cu.CUdeviceptr(address), value & 0xFFFFFFFF,
        cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT))


def stream_wait_u32(stream: int, address: int, value: int) -> None:
    """Enqueue a wait until `(int32)(*address - value) >= 0` (cyclic, so wrap-around is safe)."""
    check("cuStreamWaitValue32", cu.cuStreamWaitValue32(
        cu.CUstream(stream), cu.CUdeviceptr(address), value & 0xFFFFFFFF,
        cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ))


class StreamOps:
    """The hot path's CUDA calls on handles built once (cuda-python objects cost ~1 us each).

    One per process side (client or daemon). A CUstream only wraps the raw handle, so the cache
    by handle can never be stale; it is bounded for callers that pass many short-lived streams.
    """

    MAX_STREAMS = 64

    def __init__(self) -> None:
        require_cuda_python()
        self._streams: dict[int, Any] = {}
        self._write_flags = cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self._wait_flags = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self._ok = cu.CUresult.CUDA_SUCCESS

    def stream(self, raw: int) -> Any:
        handle = self._streams.get(raw)
        if handle is None:
            if len(self._streams) >= self.MAX_STREAMS:
                self._streams.clear()
            handle = self._streams[raw] = cu.CUstream(raw)
        return handle

    @staticmethod
    def pointer(address: int) -> Any:
        """A device pointer handle, for addresses used on every call (slab counters)."""
        return cu.CUdeviceptr(address)

    def write_u32(self, stream: int, address: Any, value: int) -> None:
        """As stream_write_u32, with `address` from `pointer()`."""
        (err,) = cu.cuStreamWriteValue32(self.stream(stream), address, value & 0xFFFFFFFF,
                                         self._write_flags)
        if err != self._ok:
            check("cuStreamWriteValue32", (err,))

    def wait_u32(self, stream: int, address: Any, value: int) -> None:
        """As stream_wait_u32, with `address` from `pointer()`."""
        (err,) = cu.cuStreamWaitValue32(self.stream(stream), address, value & 0xFFFFFFFF,
                                        self._wait_flags)
        if err != self._ok:
            check("cuStreamWaitValue32", (err,))

    def fill_layers(self, stream: int, rows: torch.Tensor, value: int) -> None:
        """Every 16-bit word of `rows` (a slot's `[n_layers, T, ...]` view: each layer
        contiguous, layers a stride apart) set to `value` on `stream`: one driver memset, so no
        kernel module is loaded (a first kernel launch blocks the host while a stream of the
        process waits on another process)."""
        width, height = rows[0].numel(), rows.shape[0]
        (err,) = cu.cuMemsetD2D16Async(rows.data_ptr(), rows.stride(0) * rows.element_size(),
                                       value & 0xFFFF, width, height, self.stream(stream))
        if err != self._ok:
            check(f"cuMemsetD2D16Async({width} x {height})", (err,))

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        """Device-to-device copy of `nbytes` on `stream` (ordered like a kernel on it)."""
        (err,) = cu.cuMemcpyAsync(dst, src, nbytes, self.stream(stream))
        if err != self._ok:
            check(f"cuMemcpyAsync({nbytes} bytes)", (err,))


class DeviceMemory:
    """Raw device memory described by `__cuda_array_interface__`, for `torch.as_tensor`."""

    def __init__(self, ptr: int, nbytes: int):
        self.ptr = ptr
        self.nbytes = nbytes

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                "version": 3, "strides": None}


def tensor_view(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 CUDA tensor over memory this process does not own (no copy, no free)."""
    import torch

    return torch.as_tensor(DeviceMemory(ptr, nbytes), device=device)


def row_views(addresses: list[int], shapes: list[tuple[int, int]], device: torch.device) -> list[torch.Tensor]:
    """uint8 [rows, row_bytes] CUDA tensors over registered host tables at `addresses` (reads
    go over UVA), one per (rows, row_bytes) of `shapes`."""
    return [tensor_view(address, rows * row_bytes, device).view(rows, row_bytes)
            for address, (rows, row_bytes) in zip(addresses, shapes, strict=True)]


class IdleStreams:
    """Non-blocking streams of this process's own, handed out one holder at a time.

    Not torch's pooled streams: the pool hands the same few streams out again and again, so a
    "new" one may be a stream that already waits on a counter another process never writes (a
    dead client's), and work put on it would wait behind that forever. A stream taken here
    belongs to its taker until it gives it back idle (synchronised), or until its owner is
    collected (give_back_when_gone); it is then handed out again rather than destroyed, because
    torch may still hold uses recorded on it.
    """

    def __init__(self) -> None:
        self._idle: dict[int, list[torch.cuda.Stream]] = {}
        self._lock = threading.Lock()
        # Streams whose owners were collected, not synchronised: a collection may run on any
        # thread (one capturing a CUDA graph, where a synchronize is refused) and at any point
        # (inside give(), holding the lock); deque.append needs neither. take() drains them.
        self._returned: collections.deque[torch.cuda.Stream] = collections.deque()

    def take(self, device_index: int) -> torch.cuda.Stream:
        with self._lock:
            while self._returned:  # on the taker's thread: idle once synchronised
                returned = self._returned.popleft()
                returned.synchronize()
                self._idle.setdefault(returned.device.index, []).append(returned)
            idle = self._idle.get(device_index)
            if idle:
                return idle.pop()
        require_cuda_python()
        import torch

        with torch.cuda.device(device_index):
            raw = check("cudaStreamCreateWithFlags",
                        cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking))
        return torch.cuda.ExternalStream(int(raw), device=torch.device("cuda", device_index))

    def give(self, stream: torch.cuda.Stream) -> None:
        """Back to the pool; the caller has synchronised it (nothing of its own is queued)."""
        with self._lock:
            self._idle.setdefault(stream.device.index, []).append(stream)


STREAMS = IdleStreams()


def new_stream(device_index: int) -> torch.cuda.Stream:
    """A stream of the caller's own (STREAMS.take); give it back with STREAMS.give once idle."""
    return STREAMS.take(device_index)


def owned_stream(owner: object, device_index: int) -> torch.cuda.Stream:
    """A stream of `owner`'s own (new_stream), given back when `owner` is collected
    (give_back_when_gone): for objects with no close() of their own."""
    stream = new_stream(device_index)
    give_back_when_gone(owner, stream)
    return stream


def give_back_when_gone(owner: object, stream: torch.cuda.Stream) -> None:
    """Hand `stream` back to STREAMS once `owner`, its only user from now on, is collected; the
    next take() synchronises it before handing it out."""
    weakref.finalize(owner, STREAMS._returned.append, stream).atexit = False  # CUDA may be gone at exit
