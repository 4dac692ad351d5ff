"""Captured lookups (client/captured.py) following what a mapped client maps, on a real daemon
process: a reload, a restart on other tables with no lookup() calls (the upkeep thread), another
geometry, and close.

A CUDA graph needs a GPU; here the client is a mapped CPU client and the kernel runs under
Triton's interpreter, so each launch (`_launch`, what record() queues and a graph replays)
stands for one replay of a graph that recorded it; on two programs, so that a launch under way when the tables change is one of
several. What is checked is what the GPU test (tests/gpu/test_captured_gpu.py) checks: every row
is the old tables', the new ones' or NaN, a reload switches whole replays, no old row comes after a
new one, replays with NaN rows are reported by check(), the old mapping is freed once no replay
can read it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from helpers import point, reload, row_kinds, rows_match, wait_until
from reference import interpreted_gather, random_ids, record_launches

from engramd.client import BadRequestError, DaemonUnavailableError, EngramClient, ReplayFailedError
from engramd.client.captured import CapturedLookup
from engramd.client.geometry import DEMO_CONFIG, TableGeometry
from engramd.client.shared.connection import probe
from engramd.kernels import descriptor as desc
from engramd.server.synthetic import write_synthetic_checkpoint

pytest.importorskip("triton")

TOKENS = 12
UPKEEP_WAIT_S = 60.0


@pytest.fixture
def interpreted(monkeypatch):
    """The gather kernel under the interpreter, where the captured lookup imports it from."""
    module = interpreted_gather("engramd_gather_triton_captured")
    monkeypatch.setitem(sys.modules, "engramd.kernels.gather_triton", module)
    yield module
    sys.modules.pop("engramd_gather_triton_captured", None)


def capture(client: EngramClient):
    buffer = torch.full((TOKENS, client.geometry.n_layers, client.geometry.heads), -1,
                        dtype=torch.int64)
    # capturable_lookup, past its refusal of the CPU; all SMs: the interpreter's two programs
    return client._captures.make(buffer, None, 1.0)


def out_of_range(ids: np.ndarray, rows: list[int]) -> int:
    """IDs a gather counts: not DEAD (-1), outside their layer's table."""
    return int(sum(((ids[:, layer] != -1) & ((ids[:, layer] < 0) | (ids[:, layer] >= n))).sum()
                   for layer, n in enumerate(rows)))


def replay(captured, ids: np.ndarray) -> np.ndarray:
    captured.ids[:ids.shape[0]].copy_(torch.from_numpy(ids))
    return captured._launch(ids.shape[0], None).double().numpy()


@contextmanager
def captured_then_reloaded(daemon_factory, first, second, reference, tmp_path, seed: int):
    """A mapped client of a daemon serving `first` (its tables a symlink), a captured lookup
    whose first replay read them, then `engramd reload` onto `second`: (client, captured, ids,
    the reload's status)."""
    current = tmp_path / "current"
    point(current, first)
    daemon = daemon_factory(tables=current)
    ids = random_ids(np.random.default_rng(seed), TOKENS, reference.rows, reference.heads)
    with EngramClient(daemon.socket, mode="mapped", max_tokens=TOKENS) as client:
        captured = capture(client)
        assert rows_match(replay(captured, ids), reference, ids)
        point(current, second)
        status = reload(daemon)
        assert (status["exit"], status["state"]) == (0, "done"), status
        yield client, captured, ids, status


def replays_until_new(captured, ids, old, new, enough: int, timeout: float) -> dict[str, int]:
    """Replay until `enough` replays read only the new tables; count the replays with rows of
    each kind (row_kinds). No old row after a new one."""
    seen = {"old": 0, "nan": 0, "new": 0, "only_new": 0}

    def step() -> bool:
        kinds = row_kinds(replay(captured, ids), ids, old, new)
        assert "old" not in kinds or seen["new"] == 0, f"old rows after new ones: {seen}"
        for kind in kinds:
            seen[kind] += 1
        seen["only_new"] += kinds == {"new"}
        return seen["only_new"] >= enough

    wait_until(step, timeout=timeout, step=0.0)
    return seen


def test_captured_replays_equal_the_reference_and_keep_their_slot(daemon_factory, reference,
                                                                  interpreted, monkeypatch):
    daemon = daemon_factory()
    rng = np.random.default_rng(41)
    launched = record_launches(interpreted, monkeypatch)
    with EngramClient(daemon.socket, mode="mapped", max_tokens=TOKENS, slots=3) as client:
        captured = capture(client)
        assert captured.slot == 2, "the last free slot"
        launched.clear()  # the warm-up's
        bad = 0
        for tokens in (1, 5, TOKENS, 5):
            ids = random_ids(rng, tokens, reference.rows, reference.heads)
            assert rows_match(replay(captured, ids), reference, ids), f"{tokens} tokens"
            bad += out_of_range(ids, reference.rows)
        assert bad > 0
        # 48 rows fit one round of wide blocks on two programs, 240 do not (captured_block_rows)
        assert [(launch.grid, launch.block_rows) for launch in launched] == \
            [(2, interpreted.WIDE_BLOCK_ROWS)] + [(2, interpreted.DEFAULT_BLOCK_ROWS)] * 3
        captured.ids.fill_(-1)  # DEAD: counts nothing
        assert captured.record(TOKENS).shape == (len(reference.rows), TOKENS, reference.heads, 256)
        assert captured.counts() == {"replays": 5, "poisoned": 0, "out_of_range": bad, "abandoned": 0}
        assert captured._programs == 2, "a launch of several programs: the last one closes it"
        captured.check()
        ids = random_ids(rng, 3, reference.rows, reference.heads)
        assert {client.lookup(torch.from_numpy(ids)).slot for _ in range(6)} == {0, 1}
        with pytest.raises(BadRequestError, match="belongs to a captured lookup"):
            client.lookup(torch.from_numpy(ids), slot=2)
        with pytest.raises(BadRequestError, match="already belongs"):
            client._captures.make(captured.ids, 2, None)
        with pytest.raises(BadRequestError, match="tokens 13"):
            captured.record(TOKENS + 1)
        before = captured.rows(3).clone()
        captured.close()
        assert torch.equal(captured._launch(3, None), before), "a closed capture writes nothing"
        with pytest.raises(ReplayFailedError, match="closed") as failed:
            captured.check()
        assert failed.value.replays == 1
        assert {client.lookup(torch.from_numpy(ids)).slot for _ in range(6)} == {0, 1, 2}


def test_a_record_reads_the_engines_ids_in_place_and_names_what_it_cannot_read(
        daemon_factory, reference, interpreted):
    """record(T, ids=...) gathers the engine's own tensor, not the buffer; IDs that are not what
    the buffer's variants were warmed on are refused, each naming what differs, before anything
    is launched."""
    daemon = daemon_factory()
    rng = np.random.default_rng(43)
    with EngramClient(daemon.socket, mode="mapped", max_tokens=TOKENS) as client:
        captured = capture(client)
        layers, heads = captured.ids.shape[1:]
        ids = random_ids(rng, 5, reference.rows, reference.heads)
        engine = torch.from_numpy(ids)
        assert captured.why_not_in_place(engine) is None
        launches = captured.counts()["replays"]
        # the buffer holds DEAD IDs only, whose rows are zeros: a gather of it would not match
        assert rows_match(captured.record(5, ids=engine).double().numpy(), reference, ids)
        launches += 1
        assert captured.counts()["replays"] == launches
        # 8 bytes past the start of an allocation (aligned, as the buffer is)
        shifted = torch.zeros(5 * layers * heads + 1, dtype=torch.int64)[1:].view(5, layers, heads)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64)

        refused = {
            "torch.int32 on cpu; the buffer is torch.int64": engine.to(torch.int32),
            f"shape \\[5, {layers}, {heads + 1}\\]": zeros(5, layers, heads + 1),
            f"shape \\[{TOKENS + 1}, ": zeros(TOKENS + 1, layers, heads),
            f"strides \\[1, 5, {5 * layers}\\], not contiguous": zeros(heads, layers, 5).permute(2, 1, 0),
            "address 0x[0-9a-f]+ is not 16-byte aligned and the buffer's \\(0x[0-9a-f]+\\) is$": shifted,
        }
        for why, bad in refused.items():
            with pytest.raises(BadRequestError, match=f"IDs to read in place: {why}"):
                captured.record(5, ids=bad)
        with pytest.raises(BadRequestError, match="5 tokens of IDs for a lookup of 4"):
            captured.record(4, ids=engine)
        assert captured.counts()["replays"] == launches, "a refused record launched nothing"


def test_a_step_recorded_a_layer_a_launch_equals_the_reference_and_counts_once(
        daemon_factory, reference, interpreted, caplog):
    """record(T, layers=...) launch by launch, reading the engine's IDs in place: the rows of
    the whole step, one replay counted per step (at its last layer's launch); layers that are
    not a range within the tables', or that do not start a step or go on where its last launch
    ended, are refused before anything is launched; a step begun over an open one is counted
    abandoned, and check() logs it once."""
    daemon = daemon_factory()
    rng = np.random.default_rng(44)
    with EngramClient(daemon.socket, mode="mapped", max_tokens=TOKENS) as client:
        captured = capture(client)
        n_layers = client.geometry.n_layers
        ids = random_ids(rng, 7, reference.rows, reference.heads)
        engine = torch.from_numpy(ids)
        captured.rows(7).fill_(5.0)
        launches = captured.counts()["replays"]
        for layer in range(n_layers):
            captured.record(7, ids=engine, layers=range(layer, layer + 1))
            assert captured.counts()["replays"] == launches + (layer == n_layers - 1)
        assert rows_match(captured.rows(7).double().numpy(), reference, ids)
        for bad in (range(0), range(1, n_layers + 1), range(0, n_layers, 2), (0, 1)):
            with pytest.raises(BadRequestError, match="a range of step 1 within"):
                captured.record(7, ids=engine, layers=bad)
        with pytest.raises(BadRequestError, match="in layer order from layer 0.*no step is under way"):
            captured.record(7, ids=engine, layers=range(1, n_layers))
        assert captured.counts()["replays"] == launches + 1, "a refused record launched nothing"
        captured.record(7, ids=engine, layers=range(0, 1))
        captured.record(7, ids=engine, layers=range(0, 1))  # begun anew over the open step
        captured.record(7, ids=engine, layers=range(1, n_layers))
        assert captured.counts()["replays"] == launches + 2
        assert captured.counts()["abandoned"] == 1
        with caplog.at_level(logging.WARNING, logger="engramd.client"):
            captured.check()
            captured.check()
        assert caplog.text.count("1 steps of a captured lookup were left open") == 1, caplog.text


def test_the_warm_up_launches_every_variant_a_record_launches(daemon_factory, reference,
                                                              interpreted, monkeypatch):
    """A capture cannot load a kernel: every (block size, sorted, sort size) that a record of
    1..TOKENS tokens launches, of every layer or of one, the warm-up launched first. With sorted
    reads from 4 tokens, the
    interpreter's two programs (on which 1 token, 48 rows, takes wide blocks and 2 tokens
    narrow ones), and the sort's sizes warmed as on a GPU."""
    monkeypatch.setattr(CapturedLookup, "_sort_kernels_vary", lambda self: True)
    daemon = daemon_factory(extra=["--sort-min-tokens", "4"])
    launched = []
    original = interpreted.GatherPlan.__call__

    def recording(plan, ids, out=None, **kwargs):
        layers = kwargs["layers"] or range(ids.shape[1])
        keys = (ids.shape[0] * len(layers) * ids.shape[2] - 1).bit_length() if kwargs["sort"] else 0
        launched.append((kwargs["block_rows"], kwargs["sort"], keys))
        return original(plan, ids, out, **kwargs)

    monkeypatch.setattr(interpreted.GatherPlan, "__call__", recording)
    with EngramClient(daemon.socket, mode="mapped", max_tokens=TOKENS) as client:
        buffer = torch.full((TOKENS, client.geometry.n_layers, client.geometry.heads), -1,
                            dtype=torch.int64)
        captured = client._captures.make(buffer, None, 1.0)
        warmed = set(launched)
        launched.clear()
        for tokens in range(1, TOKENS + 1):
            captured.record(tokens)
            for layer in range(client.geometry.n_layers):
                captured.record(tokens, layers=range(layer, layer + 1))
        recorded = set(launched)
    assert recorded <= warmed, f"recorded, never warmed: {recorded - warmed}"
    assert {(block, sort) for block, sort, _ in recorded} == {
        (interpreted.WIDE_BLOCK_ROWS, False), (interpreted.DEFAULT_BLOCK_ROWS, False),
        (interpreted.DEFAULT_BLOCK_ROWS, True)}, "each kind of launch, so that the check means something"
    assert len({keys for _, sort, keys in recorded if sort}) > 1, "sorts of more than one size class"


def test_captured_replays_follow_a_reload(daemon_factory, demo_checkpoint, reference,
                                          second_checkpoint, second_reference, tmp_path, interpreted):
    with captured_then_reloaded(daemon_factory, demo_checkpoint, second_checkpoint, reference,
                                tmp_path, seed=42) as (client, captured, ids, _):
        # No lookup() calls: the watch and upkeep threads map the new tables.
        seen = replays_until_new(captured, ids, reference, second_reference, 3, UPKEEP_WAIT_S)
        assert seen["nan"] == 0, f"a reload poisons nothing: {seen}"
        assert seen["new"] == seen["only_new"], f"a reload switches whole replays: {seen}"
        wait_until(lambda: not client._mapped_path.old_mappings, timeout=UPKEEP_WAIT_S)
        captured.check()
        assert captured.counts()["poisoned"] == 0


def test_a_restart_on_other_tables_reaches_the_captured_lookup_without_a_lookup_call(
        daemon_factory, reference, second_checkpoint, second_reference, interpreted):
    first = daemon_factory(instance="cap")
    ids = random_ids(np.random.default_rng(43), TOKENS, reference.rows, reference.heads)
    client = EngramClient(first.socket, mode="mapped", max_tokens=TOKENS, reconnect_timeout=60)
    try:
        captured = capture(client)
        assert rows_match(replay(captured, ids), reference, ids)
        first.proc.kill()
        first.proc.wait()
        for _ in range(3):  # the mapping stays: replays read it with no daemon
            assert rows_match(replay(captured, ids), reference, ids)
        daemon_factory(instance="cap", tables=second_checkpoint, shm_dir=first.shm_dir,
                       workdir=first.workdir)
        seen = replays_until_new(captured, ids, reference, second_reference, 3, UPKEEP_WAIT_S)
        assert seen["nan"] >= 1, f"the replay that adopts the remap is poisoned: {seen}"
        with pytest.raises(ReplayFailedError, match="unmapped") as failed:
            captured.check()
        assert failed.value.replays == seen["nan"]
        captured.check()  # told once
        assert rows_match(replay(captured, ids), second_reference, ids)
    finally:
        client.close()


def test_a_captured_lookup_outlives_a_daemon_away_longer_than_reconnect_timeout(
        daemon_factory, reference, interpreted):
    """Once the client's reconnect had found no daemon, its captured lookups were lost for good
    and its slots let go. Now the upkeep tries again, one attempt a turn (stats() says at once
    meanwhile that there is no daemon), and without a lookup() call the replays read the
    restarted daemon's tables into the same slot memory."""
    first = daemon_factory(instance="away")
    ids = random_ids(np.random.default_rng(46), TOKENS, reference.rows, reference.heads)
    client = EngramClient(first.socket, mode="mapped", max_tokens=TOKENS, reconnect_timeout=1)
    try:
        captured = capture(client)
        address = client.slot_rows(captured.slot).data_ptr()
        assert rows_match(replay(captured, ids), reference, ids)
        first.proc.kill()
        first.proc.wait()

        def none_there() -> bool:
            try:
                client.stats()
            except DaemonUnavailableError as exc:
                return "not registered: no daemon answered" in exc.message
            return False

        wait_until(none_there, timeout=UPKEEP_WAIT_S, step=0.2)
        daemon_factory(instance="away", shm_dir=first.shm_dir, workdir=first.workdir)
        wait_until(lambda: rows_match(replay(captured, ids), reference, ids), timeout=UPKEEP_WAIT_S,
                   step=0.1)
        assert client.slot_rows(captured.slot).data_ptr() == address and client.rows_generation == 0
        with contextlib.suppress(ReplayFailedError):  # the replays while nothing was mapped, if any
            captured.check()
        captured.check()
    finally:
        client.close()


def test_a_restart_on_another_geometry_poisons_the_capture_for_good(daemon_factory, reference,
                                                                    tmp_path, interpreted):
    first = daemon_factory(instance="geo")
    ids = random_ids(np.random.default_rng(44), TOKENS, reference.rows, reference.heads)
    wider = write_synthetic_checkpoint(
        TableGeometry.from_config({**DEMO_CONFIG, "engram_vocab_size": 700}), tmp_path / "wider", seed=1)
    client = EngramClient(first.socket, mode="mapped", max_tokens=TOKENS, reconnect_timeout=60)
    try:
        captured = capture(client)
        epoch = client.epoch  # before the restart: the upkeep may register anew before the start returns
        first.proc.kill()
        first.proc.wait()
        daemon_factory(instance="geo", tables=wider, shm_dir=first.shm_dir, workdir=first.workdir)
        wait_until(lambda: client.epoch != epoch and client.client_id is not None, timeout=UPKEEP_WAIT_S)
        for _ in range(3):
            assert np.isnan(replay(captured, ids)).all()
        with pytest.raises(ReplayFailedError, match="another geometry"):
            captured.check()
        with pytest.raises(ReplayFailedError, match="another geometry"):
            captured.check()  # for good
        with pytest.raises(ReplayFailedError, match="another geometry"):
            captured.record(TOKENS)
    finally:
        client.close()


def test_the_adapter_hashes_into_a_captured_lookup_and_picks_its_layers(daemon_factory, reference,
                                                                        interpreted):
    """The runner adapter's capture path: hash_into writes a step's hash IDs into the buffer,
    the launch reads them, layer_rows picks a layer; a CPU client refuses the public call."""
    from engramd.client import CaptureUnsupportedError
    from engramd.client.adapter import EngramRunnerAdapter

    daemon = daemon_factory()
    vocab = DEMO_CONFIG["engram_compressed_vocab_size"]
    token_map = (np.arange(vocab + 1000) % vocab).astype(np.int32)  # raw token -> compressed ID
    with EngramRunnerAdapter(daemon.socket, mode="mapped", max_tokens=TOKENS,
                             token_map=token_map) as runner:
        with pytest.raises(CaptureUnsupportedError, match="cpu client"):
            runner.capturable_lookup()
        buffer = torch.full((TOKENS, 2, reference.heads), -1, dtype=torch.int64)
        captured = runner.client._captures.make(buffer, None, None)
        tokens = torch.tensor([5, 17, 3, 3, 40, 9, 11], dtype=torch.int64)
        state = runner.hash_into(captured, tokens)
        ids = runner.hasher.hash(tokens).numpy()
        assert np.array_equal(captured.ids[:7].numpy(), ids)
        rows = captured._launch(7, None)
        expected = reference.expected(ids)
        for index, layer_id in enumerate(runner.geometry.layer_ids):
            assert np.array_equal(runner.layer_rows(rows, layer_id).double().numpy(), expected[index])
        with pytest.raises(ValueError, match="no Engram table"):
            runner.layer_rows(rows, 7)
        more = torch.tensor([2, 8], dtype=torch.int64)  # the next step carries the look-back
        runner.hash_into(captured, more, state=state)
        whole = runner.hasher.hash(torch.cat([tokens, more])).numpy()
        assert np.array_equal(captured.ids[:2].numpy(), whole[7:])
        with pytest.raises(ValueError, match="buffer holds 12"):
            runner.hash_into(captured, torch.zeros(TOKENS + 1, dtype=torch.int64))


def test_an_idle_engine_lets_the_replaced_tables_go_and_reads_the_new_ones(
        daemon_factory, demo_checkpoint, reference, second_checkpoint, second_reference, tmp_path,
        interpreted):
    """No replay after a reload: the client catches the descriptor up by itself (after
    CATCH_UP_S), unmaps the old tables, and the first replay reads the new ones."""
    with captured_then_reloaded(daemon_factory, demo_checkpoint, second_checkpoint, reference,
                                tmp_path, seed=45) as (client, captured, ids, status):
        wait_until(lambda: client.tables_id == status["tables"], timeout=UPKEEP_WAIT_S)
        wait_until(lambda: not client._mapped_path.old_mappings, timeout=UPKEEP_WAIT_S)
        assert rows_match(replay(captured, ids), second_reference, ids), "the first replay after"
        assert captured.counts()["poisoned"] == 0


def test_overlapping_replays_are_caught_by_check_and_poison_the_capture(daemon_factory, reference,
                                                                         interpreted):
    """Replays of one captured lookup at once on two streams leave counts no launch of one grid
    can (BEGUN past two grids, never reset): check() says so, and from then on replays write
    NaN rather than rows of tables the descriptor can no longer switch away from."""
    daemon = daemon_factory()
    ids = random_ids(np.random.default_rng(46), TOKENS, reference.rows, reference.heads)
    with EngramClient(daemon.socket, mode="mapped", max_tokens=TOKENS) as client:
        captured = capture(client)
        assert rows_match(replay(captured, ids), reference, ids)
        captured.check()
        captured.descriptor.block[desc.BEGUN] = 2 * captured._programs  # two grids: still possible
        captured.check()
        captured.descriptor.block[desc.BEGUN] = 2 * captured._programs + 1
        with pytest.raises(ReplayFailedError, match="ran at once"):
            captured.check()
        assert np.isnan(replay(captured, ids)).all()


def test_captured_replays_reach_the_daemons_counts(daemon_factory, reference, interpreted):
    """The daemon counts a captured engine's lookups as it counts lookup()'s: replays, their
    rows (tokens x layers x heads) and out-of-range IDs, with the heartbeats; poisoned replays
    looked nothing up."""
    daemon = daemon_factory()
    rng = np.random.default_rng(47)
    with EngramClient(daemon.socket, mode="mapped", max_tokens=TOKENS) as client:
        captured = capture(client)
        bad = 0
        for tokens in (TOKENS, 3, 7):
            ids = random_ids(rng, tokens, reference.rows, reference.heads)
            replay(captured, ids)
            bad += out_of_range(ids, reference.rows)
        rows = (TOKENS + 3 + 7) * len(reference.rows) * reference.heads

        def reported() -> bool:
            stats = probe(daemon.socket, "stats", 5.0).body.encode()
            mine = [c for c in stats["clients"] if c["client_id"] == client.client_id]
            return (stats["lookups"], mine[0]["rows"], stats["out_of_range"]) == (3, rows, bad)

        wait_until(reported, timeout=UPKEEP_WAIT_S)
        # A closed capture's counts stay told: the heartbeats' counts never go back.
        path = client._mapped_path
        told = path.since_registered(path.mapped_counts())
        captured.close()
        assert path.since_registered(path.mapped_counts()) == told == {
            "lookups": 3, "rows": rows, "out_of_range": bad}
