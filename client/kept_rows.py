"""The slot memory that outlives a registration: kept for the next one, or retired when it moves.

A client's slots keep their address across daemon restarts while the daemon keeps the client's
mode and layout, so callers may hold persistent views of them (slot_rows, captured CUDA graphs).
Not here: the slot memory itself (client/served.py's slab views, client/shared/mapped.py's LocalSlots).
"""

from __future__ import annotations

import logging
from typing import Any

from engramd.client.shared.handles import Attachment
from engramd.client.shared.slab import SlabLayout

log = logging.getLogger("engramd.client")


class KeptRows:
    """The last registration's slot memory, held for the next (`kept`), and memory whose rows
    moved (`retired`), mapped until close(); `generation` counts the moves (rows_generation)."""

    def __init__(self) -> None:
        self.kept: Any = None  # see keep
        self.retired: list[Any] = []  # slot memory that moved, still mapped for old views
        self.generation = 0  # bumped when the slots' rows move (see slot_rows)

    def hold(self, slab: Any) -> bool:
        """Keep `slab` for the next registration; False (not taken) if one is held already."""
        if self.kept is not None:
            return False
        self.kept = slab
        return True

    def keep(self, kind: type[Any], attachment: Attachment | None, layout: SlabLayout) -> Any:
        """After a re-registration: the slot memory of the last one, now holding the new slab
        (if any), when it is of the same kind and layout; else None (and it is let go).

        So the rows of a slot stay at one address for the client's life, across daemon restarts,
        as long as the daemon keeps the client's mode and layout: callers may keep persistent
        views of them (slot_rows), as captured CUDA graphs need."""
        kept, self.kept = self.kept, None
        if kept is None:
            return None
        if type(kept) is not kind or kept.layout != layout:
            log.warning("the daemon re-registered this client with another mode or layout: its "
                        "rows move to a new address")
            self.retire(kept)
            return None
        try:
            if attachment is not None:
                kept.rebind(attachment)
        except BaseException:
            self.retire(kept)
            raise
        return kept

    def retire(self, rows: Any) -> None:
        """Slot memory whose rows moved: kept mapped until close(), so that views of it taken
        before (a captured graph's) read stale rows instead of freed or reused memory."""
        self.generation += 1
        self.retired.append(rows)

    def close(self) -> None:
        leftovers = [self.kept, *self.retired]  # a re-registration that never came
        self.kept, self.retired = None, []
        for rows in leftovers:
            if rows is not None:
                rows.close()
