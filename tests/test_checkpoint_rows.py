"""An engine plugin's check of the checkpoint's rows against the daemon's (client/engines/shared.py,
CheckpointRows): a NaN's bits are not part of the contract, every other bit is.

The daemon's GPU kernel writes NaN as 0x7FC0, the torch reference the check dequantizes with as
0xFFFF (x86): a checkpoint with scale byte 255 (an all-scale-bytes test checkpoint) must load. The
client here stands for a GPU daemon's: it serves the checkpoint's own rows with the kernel's NaN.
"""

from __future__ import annotations

import pytest
import torch

from engramd.client.engines.shared import CheckpointRows, PluginError
from engramd.client.geometry import TableGeometry
from engramd.kernels.gather_ref import dequantize_rows

KERNEL_NAN = 0x7FC0  # the Triton kernel's; the reference's is 0xFFFF on x86
OTHER_NAN = 0x7FC1  # served where the reference's NaN is already the kernel's (another CPU)


class ServedLikeTheGpuKernel:
    """The parts of an EngramClient the check uses, serving `tables` (packed uint8 per layer)
    as the Triton kernel does: the reference's values, every NaN as 0x7FC0 (or, where that is
    the reference's own NaN, as another NaN, so that the payloads differ). `flip`: a (layer,
    row) whose first value of its second scale block is served one unit in the last place off."""

    socket_path = "/run/engramd/engramd.sock"
    device = torch.device("cpu")

    def __init__(self, geometry: TableGeometry, tables: list[torch.Tensor], flip=None):
        self.geometry, self.shard, self.tables, self.flip = geometry, geometry.shard(0, 1), tables, flip
        self.max_tokens = 4096
        self.nan_payloads_changed = 0

    def lookup(self, ids: torch.Tensor, slot: int):
        rows = []
        for layer, table in enumerate(self.tables):
            layer_ids = ids[:, layer, :].clamp(min=0)
            out = dequantize_rows(table[layer_ids], self.geometry.head_dim)
            nan = torch.isnan(out)
            bits = out.view(torch.int16)
            served = KERNEL_NAN if bool((bits[nan] != KERNEL_NAN).any()) else OTHER_NAN
            self.nan_payloads_changed += int((bits[nan] != served).sum())
            bits[nan] = served
            if self.flip is not None and self.flip[0] == layer:
                bits[ids[:, layer, :] == self.flip[1], 32] ^= 1
            rows.append(out)
        return type("Future", (), {"wait": lambda _self: rows})()


@pytest.fixture(scope="module")
def checkpoint():
    """The demo geometry's tables, random bytes, every row's first scale byte 255 (UE8M0's NaN:
    its first block NaN) and no E4M3 NaN (0x7F, 0xFF) elsewhere: every other value is a number."""
    geometry = TableGeometry.named("demo")
    generator = torch.Generator().manual_seed(5)
    tables = []
    for rows in geometry.rows:
        table = torch.randint(0, 256, (rows, geometry.row_bytes), dtype=torch.uint8, generator=generator)
        values = table[:, :geometry.head_dim]
        values[(values & 0x7F) == 0x7F] = 0
        table[:, geometry.head_dim] = 255
        table[:, geometry.head_dim + 1:][table[:, geometry.head_dim + 1:] == 255] = 127  # no other NaN block
        tables.append(table)
    return geometry, tables


def load(client, layer: int, table: torch.Tensor) -> None:
    """The engine's loader handing in the layer's weight, then its scales."""
    check = CheckpointRows(client, layer, PluginError, slot=0, check_still_served=lambda: None)
    head_dim = client.geometry.head_dim
    check.hand("weight", table[:, :head_dim].view(torch.float8_e4m3fn))
    check.hand("scale", table[:, head_dim:])


def test_a_checkpoint_with_nan_scales_loads_against_the_kernels_nan(checkpoint):
    geometry, tables = checkpoint
    client = ServedLikeTheGpuKernel(geometry, tables)
    for layer, table in enumerate(tables):
        load(client, layer, table)
    assert client.nan_payloads_changed > 0, "the reference's NaN was already the kernel's: nothing tested"


def test_one_unit_in_the_last_place_is_another_checkpoint(checkpoint):
    geometry, tables = checkpoint
    middle = (geometry.offsets[1][3] + geometry.offsets[1][4]) // 2  # a row the check samples
    client = ServedLikeTheGpuKernel(geometry, tables, flip=(1, middle))
    load(client, 0, tables[0])
    with pytest.raises(PluginError, match=f"other rows than this checkpoint's .*row {middle}, head 3"):
        load(client, 1, tables[1])
