"""Pinning in parts (client/shared/host_pin.py) on a GPU: every byte of every range reaches the device at
its own address, read-only pins included, and a failed registration leaves nothing pinned."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from engramd.client.shared import cuda
from engramd.client.shared.cuda import CudaError
from engramd.client.shared.host_pin import PART_ALIGN, HostRegistration

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def shared_buffer(nbytes: int, seed: int) -> np.ndarray:
    """Random bytes in a shared anonymous mapping (page-aligned, as the table files are)."""
    array = np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED), dtype=np.uint8)
    array[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return array


def device_copy(array: np.ndarray) -> np.ndarray:
    """The bytes as a kernel reads them through the registered address (UVA; a copy engine
    would refuse a host address given as device memory)."""
    view = cuda.tensor_view(array.ctypes.data, array.nbytes, torch.device("cuda", 0))
    return torch.bitwise_xor(view, 0).cpu().numpy()


@pytest.mark.parametrize("read_only", [False, True])
def test_every_part_of_every_range_reads_back_exactly_on_the_device(read_only):
    sizes = [9 * PART_ALIGN + 3 * 4096, 5 * 4096]  # a range cut into parts, and a small one
    arrays = [shared_buffer(n, seed) for seed, n in enumerate(sizes)]
    registration = HostRegistration([(a.ctypes.data, a.nbytes) for a in arrays],
                                    read_only=read_only, workers=4)
    try:
        assert len(registration._parts) > len(arrays)  # it really split
        for array in arrays:
            np.testing.assert_array_equal(device_copy(array), array)
    finally:
        registration.close()


def test_a_failed_registration_unpins_the_parts_that_did_register():
    first, second = shared_buffer(4 * PART_ALIGN, 1), shared_buffer(4 * PART_ALIGN, 2)
    held = HostRegistration([(second.ctypes.data, second.nbytes)], workers=1)
    try:
        with pytest.raises(CudaError, match="cudaHostRegister"):  # second's range is taken already
            HostRegistration([(first.ctypes.data, first.nbytes), (second.ctypes.data, second.nbytes)],
                             workers=4)
        # first's parts were unpinned again: registering them now succeeds
        HostRegistration([(first.ctypes.data, first.nbytes)], workers=4).close()
    finally:
        held.close()


def test_files_registered_through_huge_views_read_back_exactly_beside_a_second_registration(shm_dir):
    """HostRegistration.of_files, as the daemon and mapped clients pin tables: each range read
    by a kernel at its registered address is the file's bytes there; a second registration of
    the same files (a mapped client beside the daemon) reads the same; close() of one leaves
    the other working."""
    import os

    folder = shm_dir
    files = []
    for seed, (nbytes, offset) in enumerate([(9 * PART_ALIGN + 4096, 4096), (3 * 4096, 0)]):
        data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        (folder / f"t{seed}").write_bytes(data.tobytes())
        files.append((os.open(folder / f"t{seed}", os.O_RDONLY), offset, nbytes - offset, data[offset:]))
    ranges = [(fd, offset, nbytes) for fd, offset, nbytes, _ in files]
    first = HostRegistration.of_files(ranges, read_only=True, workers=4)
    second = HostRegistration.of_files(ranges, read_only=True, workers=2)
    try:
        for registration in (first, second):
            for address, (_, _, nbytes, expected) in zip(registration.addresses, files, strict=True):
                view = cuda.tensor_view(address, nbytes, torch.device("cuda", 0))
                np.testing.assert_array_equal(torch.bitwise_xor(view, 0).cpu().numpy(), expected)
        assert first.addresses != second.addresses  # each its own mapping of the same pages
        first.close()
        address, (_, _, nbytes, expected) = second.addresses[0], files[0]
        view = cuda.tensor_view(address, nbytes, torch.device("cuda", 0))
        np.testing.assert_array_equal(torch.bitwise_xor(view, 0).cpu().numpy(), expected)
    finally:
        first.close()
        second.close()
        for fd, *_ in files:
            os.close(fd)
