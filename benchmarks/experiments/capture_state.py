"""What CUDA says of stream capture, for the capture experiments (capture_beside_keeper.py,
capture_trace_plugin.py): a thread's capture interaction mode and a stream's capture status,
as short names ("Global", "Relaxed"; "None", "Active", "Invalidated")."""

from __future__ import annotations

from typing import Any


def thread_capture_mode() -> str:
    """This thread's capture interaction mode, left as it was (engramd's own threads set theirs
    to relaxed; the engine's thread should still be in the default, global)."""
    from cuda.bindings import runtime as cudart

    err, mode = cudart.cudaThreadExchangeStreamCaptureMode(
        cudart.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal)
    if int(err):
        return f"error {err}"
    cudart.cudaThreadExchangeStreamCaptureMode(mode)
    return mode.name.removeprefix("cudaStreamCaptureMode")


def capture_status(stream: Any) -> str:
    """Whether `stream` (a torch.cuda.Stream) captures now."""
    from cuda.bindings import runtime as cudart

    err, status = cudart.cudaStreamIsCapturing(stream.cuda_stream)
    return status.name.removeprefix("cudaStreamCaptureStatus") if not int(err) else f"error {err}"
