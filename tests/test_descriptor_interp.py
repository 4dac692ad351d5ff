"""A gather that reads its tables through a descriptor block (kernels/descriptor.py), under
Triton's CPU interpreter, against the plain-torch reference.

What a CUDA graph records is a step of one launch, or of several (a layer each), with fixed
arguments; each step here stands for one replay of it. The descriptor must switch tables
between two steps and never inside one, poison to NaN rows that read nothing, and count what
the owner reports.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from reference import assert_same, interpreted_gather, small_geometry

from engramd.client.geometry import DEAD_ID
from engramd.kernels import descriptor as desc
from engramd.kernels import gather_ref

pytest.importorskip("triton")

BLOCK_ROWS = 64
PROGRAMS = 3  # more than one program: the last to end closes the launch


@pytest.fixture(scope="module")
def kt():
    name = "engramd_gather_triton_described"
    yield interpreted_gather(name)
    sys.modules.pop(name, None)


def random_tables(geo, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (rows, geo.row_bytes), dtype=torch.uint8, generator=gen)
            for rows in geo.rows]


def lookup_ids(geo, tokens: int, seed: int) -> torch.Tensor:
    """Rows in and out of the tables, DEAD, repeats."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-3, max(geo.rows) + 5, (tokens, geo.n_layers, geo.heads), generator=gen)
    ids[torch.rand(ids.shape, generator=gen) < 0.1] = DEAD_ID
    ids[1::4] = ids[0]
    return ids


def contents_of(tables, shard, cache=None) -> desc.Contents:
    return desc.Contents.of([t.data_ptr() for t in tables], [t.shape[0] for t in tables],
                            shard.row_ranges, cache)


def small_cache(geo):
    """An empty hot-row cache of a few sets for these tables (every row admitted: admit_min 0)."""
    from engramd.kernels import hot_cache

    layout = hot_cache.CacheLayout(sets=4, row_bytes=geo.row_bytes, sketch_bits=10, log_entries=256)
    return hot_cache.HotCache(layout, geo.n_layers, "cpu", admit_min=0)


class World:
    """A plan over tables A, a descriptor first describing A, and a second set of tables B."""

    def __init__(self, kt, shards: int = 1, rank: int = 0):
        self.geo = small_geometry()
        self.shard = self.geo.shard(rank, shards)
        self.a, self.b = random_tables(self.geo, 1), random_tables(self.geo, 2)
        self.plan = kt.GatherPlan(self.a, self.shard)
        self.descriptor = desc.TableDescriptor(contents_of(self.a, self.shard), torch.device("cpu"), "A")

    def launch(self, ids: torch.Tensor, sort: bool = False, layers: range | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.plan.output_shape(ids.shape[0]), dtype=torch.bfloat16)
        self.plan(ids, out, descriptor=self.descriptor, num_programs=PROGRAMS, block_rows=BLOCK_ROWS,
                  sort=sort, layers=layers)
        return out

    def want(self, tables, ids) -> tuple[torch.Tensor, int]:
        return gather_ref.gather(tables, ids, self.shard)

    def words(self) -> list[int]:
        return self.descriptor.snapshot()


@pytest.mark.parametrize("shards", [1, 2, 5])
@pytest.mark.parametrize("sort", [False, True])
def test_a_described_gather_equals_the_reference_and_counts_into_the_block(kt, shards, sort):
    world = World(kt, shards, rank=shards - 1)
    ids = lookup_ids(world.geo, 21, seed=shards)
    want, want_bad = world.want(world.a, ids)
    assert want_bad > 0, "the IDs must include out-of-range ones"
    for launch in (1, 2):
        assert_same(world.launch(ids, sort), want, f"launch {launch}, shard {shards - 1}/{shards}")
        words = world.words()
        assert words[desc.OUT_OF_RANGE] == launch * want_bad
        assert words[desc.LAUNCHES] == launch
        assert words[desc.BEGUN] == words[desc.ARRIVED] == 0, "a launch leaves its counts at zero"
        assert words[desc.POISONED_LAUNCHES] == 0


def test_tables_switch_at_the_launch_after_next_and_never_inside_one(kt):
    world = World(kt)
    ids = lookup_ids(world.geo, 40, seed=3)
    from_a, from_b = world.want(world.a, ids)[0], world.want(world.b, ids)[0]
    assert not torch.equal(from_a.view(torch.int16), from_b.view(torch.int16))
    world.descriptor.publish(contents_of(world.b, world.shard), "B")
    assert world.descriptor.reads("A") and world.descriptor.reads("B")
    assert not world.descriptor.adopted()
    # The launch that adopts B still reads A, all of its programs.
    assert_same(world.launch(ids), from_a, "the adopting launch")
    assert world.descriptor.adopted()
    assert not world.descriptor.reads("A"), "A is free once B was adopted"
    assert_same(world.launch(ids), from_b, "the launch after it")
    assert_same(world.launch(ids), from_b, "and every later one")


@pytest.mark.parametrize("sort", [False, True])
def test_a_step_gathered_a_layer_a_launch_reads_one_buffer_and_switches_after_its_last(kt, sort):
    """Each launch writes its own layer's rows and no other's; the tables switch after the
    launch that ends at the last layer (which counts the step), never between a step's launches."""
    world = World(kt)
    ids = lookup_ids(world.geo, 17, seed=7)
    from_a, from_b = world.want(world.a, ids)[0], world.want(world.b, ids)[0]
    last = world.geo.n_layers - 1
    assert last >= 1, "the geometry must have layers to split"
    world.descriptor.publish(contents_of(world.b, world.shard), "B")
    for step, want in enumerate((from_a, from_b, from_b)):
        out = torch.full(world.plan.output_shape(ids.shape[0]), 7.0, dtype=torch.bfloat16)
        for layer in range(world.geo.n_layers):
            world.launch(ids, sort, range(layer, layer + 1), out)
            assert_same(out[:layer + 1], want[:layer + 1], f"step {step}, layers up to {layer}")
            assert (out[layer + 1:] == 7.0).all(), f"step {step}: a launch of layer {layer} wrote another"
            words = world.words()
            assert words[desc.BEGUN] == words[desc.ARRIVED] == 0, "every launch closes its own counts"
            assert words[desc.LAUNCHES] == step + (layer == last), "a step counts once, at its last launch"
            assert world.descriptor.adopted() == (step > 0 or layer == last), \
                "B adopted at the first step's last launch, not before"


def test_a_step_poisoned_after_its_first_launch_counts_once_and_none_of_its_rows(kt):
    """Its rows are counted at its close, all or none, as its replay is: the client reports
    to its daemon the rows of the steps that were not poisoned."""
    world = World(kt)
    ids = lookup_ids(world.geo, 6, seed=8)
    n_layers = world.geo.n_layers
    for layer in range(n_layers):
        world.launch(ids, layers=range(layer, layer + 1))
        words = world.words()
        assert words[desc.STEP_OPEN] == (layer < n_layers - 1), "open until its last launch"
    rows = words[desc.ROWS]
    assert rows == 6 * n_layers * world.shard.owned_heads
    assert (words[desc.STEP_ROWS], words[desc.LAUNCHES]) == (0, 1)
    world.launch(ids, layers=range(0, 1))
    assert world.words()[desc.STEP_ROWS] == 6 * world.shard.owned_heads
    world.descriptor.poison()
    for layer in range(1, n_layers):
        out = world.launch(ids, layers=range(layer, layer + 1))
        assert (out[layer].view(torch.int16) == 0x7FC0).all()
    words = world.words()
    assert (words[desc.LAUNCHES], words[desc.POISONED_LAUNCHES], words[desc.ROWS]) == (2, 1, rows)
    assert words[desc.SAW_POISON] == words[desc.STEP_ROWS] == words[desc.STEP_OPEN] == 0, \
        "the step's words are cleared at its last launch"


def test_a_partial_launch_refuses_what_it_cannot_be(kt):
    world = World(kt)
    ids = lookup_ids(world.geo, 3, seed=9)
    n_layers = world.geo.n_layers
    for layers in (range(0), range(0, n_layers + 1), range(0, n_layers, 2), range(-1, 1), [0]):
        with pytest.raises(ValueError, match="layers must be a range of step 1"):
            world.plan(ids, layers=layers)
    with pytest.raises(ValueError, match="dedupe lookup gathers every layer"):
        world.plan(ids, layers=range(0, 1), dedupe=True)


def test_contents_published_before_the_last_were_adopted_wait_their_turn(kt):
    world = World(kt)
    ids = lookup_ids(world.geo, 9, seed=4)
    c = random_tables(world.geo, 3)
    world.descriptor.publish(contents_of(world.b, world.shard), "B")
    world.descriptor.publish(contents_of(c, world.shard), "C")  # B not adopted yet: C waits
    assert world.descriptor.reads("A") and world.descriptor.reads("B")
    assert not world.descriptor.reads("C")
    assert_same(world.launch(ids), world.want(world.a, ids)[0], "adopts B")
    assert world.descriptor.advance(), "B adopted: C is written"
    assert_same(world.launch(ids), world.want(world.b, ids)[0], "reads B, adopts C")
    assert_same(world.launch(ids), world.want(c, ids)[0], "reads C")
    assert not world.descriptor.reads("A") and not world.descriptor.reads("B")


def test_a_poisoned_descriptor_writes_nan_rows_counts_the_launches_and_reads_nothing(kt):
    world = World(kt)
    cache = small_cache(world.geo)
    world.descriptor.publish(contents_of(world.a, world.shard, cache), "A+cache")
    ids = lookup_ids(world.geo, 12, seed=5)
    world.launch(ids)  # adopts the cached contents
    world.launch(ids)
    reads = cache.counters.sum().item()
    assert reads > 0, "the cache the descriptor names counts the reads"
    bad = world.words()[desc.OUT_OF_RANGE]
    world.descriptor.poison()
    assert not world.descriptor.reads("A+cache")
    for launch in (1, 2):
        out = world.launch(ids)
        assert (out.view(torch.int16) == 0x7FC0).all(), "every element of every row is NaN"
        words = world.words()
        assert words[desc.POISONED_LAUNCHES] == launch
        assert words[desc.OUT_OF_RANGE] == bad, "no ID is read, none counted"
        assert cache.counters.sum().item() == reads, "nor the cache touched"
    # New contents bring it back: the adopting launch is still poisoned, the next reads them.
    world.descriptor.publish(contents_of(world.b, world.shard), "B")
    assert not world.descriptor.poisoned
    assert (world.launch(ids).view(torch.int16) == 0x7FC0).all()
    assert_same(world.launch(ids), world.want(world.b, ids)[0], "after the poison")
    assert world.words()[desc.POISONED_LAUNCHES] == 3


def test_without_a_cache_the_buffer_reads_the_tables_and_counts_in_no_cache(kt):
    world = World(kt)
    cache = small_cache(world.geo)
    ids = lookup_ids(world.geo, 12, seed=6)
    world.descriptor.publish(contents_of(world.a, world.shard, cache), "cached")
    world.launch(ids)
    world.descriptor.publish(contents_of(world.a, world.shard), "uncached")
    world.launch(ids)  # reads the cached buffer, adopts the uncached one
    counted = cache.counters.sum().item()
    assert_same(world.launch(ids), world.want(world.a, ids)[0], "without a cache")
    assert cache.counters.sum().item() == counted


def test_quiet_waits_for_the_launch_under_way_and_no_other(kt):
    world = World(kt)
    ids = lookup_ids(world.geo, 8, seed=7)
    assert world.descriptor.quiet().query(), "no launch under way"
    # A launch under way: programs have begun and not all ended.
    world.descriptor.block[desc.BEGUN] = 2
    probe = world.descriptor.quiet()
    assert not probe.query()
    world.launch(ids)  # stands for its end (ARRIVED counts from 0: this launch's last closes it)
    assert probe.query()
    # Counts that never close a launch (launches overlapped): the grace ends after wedged_s.
    world.descriptor.block[desc.BEGUN] = 5
    assert not world.descriptor.quiet().query()
    assert desc.Quiet(world.descriptor, wedged_s=0.0).query()


def test_a_described_gather_refuses_what_it_cannot_do(kt):
    world = World(kt)
    ids = lookup_ids(world.geo, 4, seed=8)
    cache = small_cache(world.geo)
    for bad in (dict(packed=True), dict(dedupe=True), dict(cache=cache),
                dict(out_of_range=torch.zeros(1, dtype=torch.int64))):
        with pytest.raises(ValueError, match="described gather"):
            world.plan(ids, descriptor=world.descriptor, **bad)
    other = desc.TableDescriptor(desc.Contents(((0, 0, 0, 0),)), torch.device("cpu"))
    with pytest.raises(ValueError, match="descriptor of 1 layers"):
        world.plan(ids, descriptor=other)
    with pytest.raises(ValueError, match="3 layers"):
        world.descriptor.publish(desc.Contents(((0, 0, 0, 0),) * 3), None)


def test_a_poisoned_launch_reads_no_table_even_at_an_unmapped_address():
    """Poisoned buffers whose tables are gone (an address nothing maps): the launch must not
    touch them. Run in a process of its own, since a read there would kill it."""
    script = textwrap.dedent("""
        import sys, torch, triton
        sys.path.insert(0, sys.argv[1])  # tests/: reference.py
        from reference import interpreted_gather, small_geometry
        from engramd.kernels import descriptor as desc
        kt = interpreted_gather("kt")
        geo = small_geometry()
        shard = geo.shard(0, 1)
        tables = [torch.zeros(rows, geo.row_bytes, dtype=torch.uint8) for rows in geo.rows]
        gone = desc.Contents.of([4096] * geo.n_layers, geo.rows, shard.row_ranges)
        d = desc.TableDescriptor(gone, torch.device("cpu"))
        d.poison()
        ids = torch.zeros(5, geo.n_layers, geo.heads, dtype=torch.int64)
        out = kt.GatherPlan(tables, shard)(ids, descriptor=d, num_programs=2)
        assert (out.view(torch.int16) == 0x7FC0).all()
        print("poisoned: read nothing")
    """)
    done = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "read nothing" in done.stdout, done.stderr[-2000:]


def test_an_idle_descriptor_catches_up_so_the_replaced_tables_can_go(kt):
    """No launch since B was selected: after `idle_s` the active buffer is rewritten with B,
    A is read by nobody, and the next launch reads B. Not while a launch or a step of several
    is under way (its later launches must read what its first read), nor before the idle
    time, nor once a launch adopted B."""
    world = World(kt)
    ids = lookup_ids(world.geo, 10, seed=9)
    world.descriptor.publish(contents_of(world.b, world.shard), "B")
    assert not world.descriptor.catch_up(idle_s=60.0), "not idle long enough"
    world.descriptor.block[desc.BEGUN] = 1  # a launch under way adopts B itself
    assert not world.descriptor.catch_up(idle_s=0.0)
    world.descriptor.block[desc.BEGUN] = 0
    out = world.launch(ids, layers=range(0, 1))  # a step open: its close adopts B
    assert not world.descriptor.catch_up(idle_s=0.0)
    world.launch(ids, layers=range(1, world.geo.n_layers), out=out)
    assert_same(out, world.want(world.a, ids)[0], "the step's launches all read A")
    assert world.descriptor.adopted()
    world.descriptor.publish(contents_of(world.a, world.shard), "A")
    world.launch(ids)  # adopts A
    world.descriptor.publish(contents_of(world.b, world.shard), "B")
    assert world.descriptor.reads("A")
    assert world.descriptor.catch_up(idle_s=0.0)
    assert not world.descriptor.reads("A") and world.descriptor.reads("B")
    assert_same(world.launch(ids), world.want(world.b, ids)[0], "the launch after the catch-up")
    assert not world.descriptor.catch_up(idle_s=0.0), "nothing left to catch up with"
    # Once a launch adopted the selected contents there is nothing to catch up with either.
    world.descriptor.publish(contents_of(world.a, world.shard), "A")
    world.launch(ids)
    assert not world.descriptor.catch_up(idle_s=0.0)
    assert_same(world.launch(ids), world.want(world.a, ids)[0], "adopted by a launch")


def test_a_step_left_open_is_counted_abandoned_and_lends_the_next_step_nothing(kt):
    """A graph that recorded a step's first launches but not its last leaves the step open; the
    next launch from layer 0 counts it in ABANDONED and begins its own step afresh: no rows, nor
    poison, of the abandoned one in it."""
    world = World(kt)
    ids = lookup_ids(world.geo, 5, seed=9)
    n_layers, heads = world.geo.n_layers, world.shard.owned_heads
    world.launch(ids, layers=range(0, 1))
    world.launch(ids, layers=range(0, 1))  # the first left open
    assert world.words()[desc.ABANDONED] == 1
    assert world.words()[desc.STEP_ROWS] == 5 * heads, "only the open step's own rows"
    assert_same(world.launch(ids), world.want(world.a, ids)[0], "a whole step over an open one")
    words = world.words()
    assert (words[desc.ABANDONED], words[desc.LAUNCHES], words[desc.ROWS]) == (2, 1, 5 * n_layers * heads)
    # An open step that a launch of it saw poisoned: the step begun over it is not.
    world.launch(ids, layers=range(0, 1))
    world.descriptor.block[desc.STEP_POISONED] = 1
    world.launch(ids)
    words = world.words()
    assert (words[desc.ABANDONED], words[desc.LAUNCHES], words[desc.POISONED_LAUNCHES]) == (3, 2, 0)
    assert words[desc.ROWS] == 2 * 5 * n_layers * heads
    assert words[desc.STEP_OPEN] == words[desc.STEP_POISONED] == words[desc.STEP_ROWS] == 0
