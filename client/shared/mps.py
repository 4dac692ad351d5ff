"""Is this process's GPU shared through an MPS server, and which one?

Kernels of different processes time-slice a GPU unless they run under the same MPS server: then a
gather the daemon launches overlaps the model's kernels as well as an in-process side stream does
(measured on the H200: README, "MPS"). Served lookups are only as cheap as in-process ones under a
shared MPS server, so the daemon and each client report what they see and the daemon compares:

- `enabled`: CUDA's own answer for this process and device (CU_DEVICE_ATTRIBUTE_MPS_ENABLED:
  contexts created on it are shared via MPS). No context is needed to ask.
- `server`: the identity of the MPS pipe folder the process would connect through
  (CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps) as "device:inode". A folder bind-mounted
  into a container keeps both numbers, so two processes in different mount namespaces that
  reach the same server report the same identity; two servers never do.

Two processes share MPS on a GPU when both are enabled and name the same server. Imported only
where CUDA is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"


@dataclass(frozen=True)
class MpsState:
    enabled: bool
    server: str  # "device:inode" of the pipe folder, "" when MPS is off or the folder is unseen

    def shares_with(self, other: MpsState) -> bool:
        return self.enabled and other.enabled and bool(self.server) and self.server == other.server

    def to_wire(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "server": self.server}

    @classmethod
    def from_wire(cls, data: Any) -> MpsState | None:
        """The client's report from a register request; None when absent or malformed."""
        if not isinstance(data, dict):
            return None
        enabled, server = data.get("enabled"), data.get("server")
        if not isinstance(enabled, bool) or not isinstance(server, str) or len(server) > 64:
            return None
        return cls(enabled, server)


def pipe_directory() -> str:
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY


def server_identity(folder: str) -> str:
    try:
        st = os.stat(folder)
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


def mps_state(device_index: int) -> MpsState:
    """What CUDA says about MPS for this process's device `device_index`."""
    from engramd.client.shared.cuda import check, cu

    check("cuInit", cu.cuInit(0))
    device = check("cuDeviceGet", cu.cuDeviceGet(device_index))
    enabled = bool(check("cuDeviceGetAttribute(MPS_ENABLED)", cu.cuDeviceGetAttribute(
        cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MPS_ENABLED, device)))
    return MpsState(enabled, server_identity(pipe_directory()) if enabled else "")
