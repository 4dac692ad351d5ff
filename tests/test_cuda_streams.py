"""engramd's own CUDA work stays out of an engine's graph captures.

The streams it queues work on are never torch's pooled ones: torch hands the same 32 streams a
device out round-robin, to engines' graph captures too, so a pooled stream of ours could be the
stream an engine is capturing (our copies recorded into its graph, or our syncs breaking the
capture) or one that waits behind a dead client's counter. Its threads enter CUDA in relaxed
capture mode, so that their calls do not spoil an engine's capture in the default mode.
Checked without a GPU: the sources, the giving back of an owned stream, the descriptor's
refusal, and what a thread's entry asks of the runtime (a stand-in for it)."""

from __future__ import annotations

import gc
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engramd.client.shared import cuda
from engramd.kernels import descriptor as desc

SOURCES = [Path(__file__).resolve().parents[1] / folder for folder in ("client", "kernels", "server")]


def test_no_source_takes_a_stream_from_torchs_pool():
    pooled = re.compile(r"torch\.cuda\.Stream\(")
    found = [f"{path.name}:{number}" for folder in SOURCES for path in sorted(folder.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if pooled.search(line)]
    assert sum(1 for folder in SOURCES for _ in folder.rglob("*.py")) > 50  # the folders were read
    assert found == [], f"streams from torch's pool (use client/shared/cuda.new_stream): {found}"


class FakeStream:
    def __init__(self):
        self.device = torch.device("cuda", 3)
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1


def test_a_stream_goes_back_when_its_owner_is_collected_and_is_drained_by_its_next_taker(monkeypatch):
    streams = cuda.IdleStreams()
    monkeypatch.setattr(cuda, "STREAMS", streams)
    stream = FakeStream()

    class Owner:
        pass

    owner = Owner()
    cuda.give_back_when_gone(owner, stream)
    gc.collect()
    assert not streams._returned  # held while its owner lives
    del owner
    gc.collect()
    # Not synchronised on the collecting thread (it may be capturing a graph), nor under a lock.
    assert list(streams._returned) == [stream] and stream.synchronized == 0
    assert streams.take(3) is stream and stream.synchronized == 1
    assert not streams._returned and streams._idle == {3: []}


def test_a_gpu_descriptor_refuses_to_be_made_without_a_stream_of_its_owners():
    nothing = desc.Contents(((0, 0, 0, 0),))
    with pytest.raises(ValueError, match="stream of its owner's own"):
        desc.TableDescriptor(nothing, torch.device("cuda", 0))
    assert desc.TableDescriptor(nothing, torch.device("cpu")).snapshot() is not None


def test_a_thread_enters_on_its_device_in_relaxed_capture_mode(monkeypatch):
    calls = []
    modes = SimpleNamespace(cudaStreamCaptureModeGlobal=0, cudaStreamCaptureModeRelaxed=2)
    runtime = SimpleNamespace(
        cudaStreamCaptureMode=modes,
        cudaSetDevice=lambda index: calls.append(("device", index)) or (0,),
        cudaThreadExchangeStreamCaptureMode=lambda mode: calls.append(("mode", mode)) or (0, 0))
    monkeypatch.setattr(cuda, "cudart", runtime)
    cuda.enter_thread(5)
    assert calls == [("device", 5), ("mode", modes.cudaStreamCaptureModeRelaxed)]
