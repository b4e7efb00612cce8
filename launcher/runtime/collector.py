"""Python's cyclic garbage collector kept out of a migration's pause.

A live worker holds some 280 k objects the collector tracks (torch's modules, the model, the plans of a
migration made while the old layout trained); a full collection walks all of them, 0.22-0.33 CPU-s
per worker on this machine. Planning a migration creates enough long-lived objects to make the next
full collection due, and it came inside the pause: `elastic bench --explain`, pp4tp2 -> pp4tp4, two of
sixteen workers collected 0.27-0.29 CPU-s (0.54 s of wall on the loaded cores) between the new
world's forming and the rebuild, the critical path's "built" 0.82 s against 0.25 s on the others.

At the start of a pause every object then alive is moved out of the collector's reach (gc.freeze: no
copy, no walk), so a collection inside the pause looks only at what the pause itself creates; once the
new layout committed its first step they are handed back (gc.unfreeze) and collected as before,
outside the pause. Nothing stays frozen once training goes on, so no cycle is kept alive for good. A
script that disabled the collector or froze objects itself manages it: then nothing is done here."""
from __future__ import annotations

import gc


class CollectorHold:
    """hold() at the start of a pause, release() once training went on; both idempotent."""

    def __init__(self) -> None:
        self.held = False

    def hold(self) -> None:
        if self.held or not gc.isenabled() or gc.get_freeze_count():
            return
        gc.freeze()
        self.held = True

    def release(self) -> None:
        if self.held:
            gc.unfreeze()
            self.held = False
