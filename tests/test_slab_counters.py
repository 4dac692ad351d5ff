"""The slab's completion counters as the device compares them: cyclic waits, and the value a
freed slab's ROWS_DONE words get so that no wait of its client stays blocked."""

from engramd.client.shared.slab import (
    DONE_AT_RELEASE,
    ROWS_DONE,
    is_release,
    release_value,
    rows_written,
    wait_passes,
)

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


def test_rows_written_tells_a_gathers_write_from_a_release():
    """ROWS_DONE at a seq the client issued: written up to it. At a release value: what the
    gathers had reached before it (DONE_AT_RELEASE) decides. FAILED names a refused lookup."""
    for last in (5, 1 << 20, U32 - 3, U32 + 2):
        seq, last = last % U32, last % U32
        before, after = (seq - 1) % U32, (seq + 1) % U32
        assert rows_written(seq, 0, 0, seq, last)  # its gather wrote ROWS_DONE = seq
        assert not rows_written(before, 0, 0, seq, last)  # not yet: the slot's previous lookup
        assert rows_written(seq, 0, 0, before, last)  # the slot's later gathers ran after it
        assert not rows_written(seq, seq, 0, seq, last)  # the daemon marked it failed
        released = release_value(last)
        assert is_release(released, last) and not is_release(seq, last)
        assert rows_written(released, 0, seq, seq, last)  # written, then the slab was released
        assert not rows_written(released, 0, before, seq, last)  # released before its gather
        if seq < 1 << 31:  # a fresh block's 0 is behind every seq below 2^31 (as ROWS_DONE's)
            assert not rows_written(released, 0, 0, seq, last)  # released, nothing ever written
        # A release by the other side, whose last seq is a few behind or ahead, is one too.
        assert is_release(release_value((last - 3) % U32), last)
        assert is_release(release_value(after), last)


class _Words:
    """A counter block's load/store over a dict: HostCounters.release's logic without CUDA."""

    def __init__(self):
        self.words = {}

    def load(self, slot, word):
        return self.words.get((slot, word), 0)

    def store(self, slot, word, value):
        self.words[(slot, word)] = value % U32


def test_a_release_keeps_what_the_gathers_reached_once():
    from engramd.client.shared.host_counters import HostCounters

    words = _Words()
    words.store(0, ROWS_DONE, 41)
    HostCounters.release(words, 0, 42)  # the daemon frees the slab: lookup 42 was never written
    assert words.load(0, DONE_AT_RELEASE) == 41 and words.load(0, ROWS_DONE) == release_value(42)
    assert rows_written(words.load(0, ROWS_DONE), 0, words.load(0, DONE_AT_RELEASE), 41, 42)
    assert not rows_written(words.load(0, ROWS_DONE), 0, words.load(0, DONE_AT_RELEASE), 42, 42)
    HostCounters.release(words, 0, 43)  # the client's watchdog releases again: 41 is kept
    assert words.load(0, DONE_AT_RELEASE) == 41
