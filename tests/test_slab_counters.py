"""The slab's completion counters as the device compares them: cyclic waits, and the value a
freed slab's ROWS_DONE words get so that no wait of its client stays blocked."""

from engramd.client.slab import release_value, wait_passes

U32 = 1 << 32


def test_waits_compare_cyclically_across_the_wrap():
    assert wait_passes(5, 5) and wait_passes(6, 5) and not wait_passes(4, 5)
    assert wait_passes(3, U32 - 2)  # the counter wrapped past the seq: done
    assert not wait_passes(U32 - 2, 3)  # the seq is ahead, across the wrap: not yet


def test_the_release_value_passes_every_wait_near_the_last_seq():
    """Waits for done lookups (behind the last enqueued seq) and for lookups the daemon never
    got (a few ahead of it) must all pass, wherever the seqs are, wrap included. The largest u32
    does not: it is behind every seq below 2^31, so those waits would block for ever."""
    for last in (0, 1, 17, 1 << 20, (1 << 31) - 3, U32 - 5):
        counter = release_value(last)
        for seq in (last - 1000, last - 1, last, last + 1, last + 64, last + 100_000):
            assert wait_passes(counter, seq % U32), (last, seq)
    assert not wait_passes(0xFFFFFFFF, 17)  # why not simply the largest value
