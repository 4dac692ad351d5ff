"""A client asking for a CUDA device where it cannot have one gets CudaUnavailableError, before
it contacts the daemon (no daemon runs here: the error must come first). The driver is
replaced by a stand-in, so these run on any machine, GPU or not."""

from __future__ import annotations

import pytest
import torch

from engramd.client import BadRequestError, CudaUnavailableError, EngramClient
from engramd.client.shared import cuda as client_cuda


class FakeDriver:
    """cuda.bindings.driver as far as require_device asks it: cuInit's result (or what it
    raises) and the device count."""

    def __init__(self, init: int | Exception = 0, count: int = 1):
        self.init, self.count = init, count

    def cuInit(self, flags: int):  # noqa: N802 - the driver's name
        if isinstance(self.init, Exception):
            raise self.init
        return (self.init,)

    def cuDeviceGetCount(self):  # noqa: N802
        return (0, self.count)


def client_error(monkeypatch, tmp_path, device: str, driver: FakeDriver) -> CudaUnavailableError:
    monkeypatch.setattr(client_cuda, "cu", driver)
    with pytest.raises(CudaUnavailableError) as caught:
        EngramClient(tmp_path / "no-daemon.sock", device=device)
    assert isinstance(caught.value, BadRequestError)
    return caught.value


def test_no_driver_on_the_machine(monkeypatch, tmp_path):
    """cuda-python raised cuda.pathfinder's DynamicLibNotFoundError from the first call."""
    missing = pytest.importorskip("cuda.pathfinder").DynamicLibNotFoundError("libcuda.so.1")
    for device in ("cuda:0", "cuda"):
        error = client_error(monkeypatch, tmp_path, device, FakeDriver(init=missing))
        assert "no CUDA driver on this machine" in error.message and f"'{device}'" in error.message


def test_a_driver_that_sees_no_gpu(monkeypatch, tmp_path):
    no_gpu = FakeDriver(init=client_cuda.CUDA_ERROR_NO_DEVICE)
    error = client_error(monkeypatch, tmp_path, "cuda:0", no_gpu)
    assert "sees no GPU" in error.message and "CUDA_VISIBLE_DEVICES" in error.message


def test_a_device_index_past_the_visible_gpus(monkeypatch, tmp_path):
    error = client_error(monkeypatch, tmp_path, "cuda:3", FakeDriver(count=2))
    assert "sees 2 GPU(s), cuda:0 to cuda:1" in error.message


def test_a_torch_without_cuda(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    error = client_error(monkeypatch, tmp_path, "cuda:0", FakeDriver())
    assert "cannot use CUDA" in error.message and torch.__version__ in error.message


@pytest.mark.parametrize("device", ["tpu", "cuda:x", 7.5])
def test_a_device_torch_does_not_know_is_a_bad_request(tmp_path, device):
    """torch's own RuntimeError (an unknown device name) came through untyped."""
    with pytest.raises(BadRequestError, match="engramd serves 'cpu' and 'cuda' clients"):
        EngramClient(tmp_path / "no-daemon.sock", device=device)
