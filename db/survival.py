"""What a job's layout survives, as the launcher last recorded it in the job's launch spec
(launcher.loop.holdings.Holdings.launch_spec: "survives" {"process", "node", "batch"}, "checkpoint_every"), read
defensively: the spec is JSON another process wrote, and jobs started by an older launcher have none.
Anything that is not exactly booleans gives None, so the pages and `elastic jobs` show nothing rather than
a guess. Here, below both, so the dashboard and the CLI read it the same way."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def survival_of(spec: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """{"process": bool, "node": bool, "checkpoint_every": int | None, "node_note": str, "batch": bool | None}
    or None when not recorded; node_note says why a node's loss ends the job whatever the layout (e.g. no
    --no-kill); batch whether the loss of the node that runs elastic-launch is survived (None: not said).
    checkpoint_every is None when the spec does not say (then no claim about checkpoints is shown)."""
    if not isinstance(spec, Mapping):
        return None
    said = spec.get("survives")
    if not isinstance(said, Mapping):
        return None
    process, node = said.get("process"), said.get("node")
    if not isinstance(process, bool) or not isinstance(node, bool):
        return None
    every = spec.get("checkpoint_every")
    ok = isinstance(every, int) and not isinstance(every, bool) and every >= 0
    note, batch = said.get("node_note"), said.get("batch")
    return {"process": process, "node": node, "checkpoint_every": every if ok else None,
            "node_note": note if isinstance(note, str) else "", "batch": batch if isinstance(batch, bool) else None}


def survival_words(sv: dict[str, Any] | None) -> str:
    """One short line of what survival_of read, e.g. "process ✓ node ✗ batch ✓"; "-" when not recorded."""
    if sv is None:
        return "-"
    said = [("process", sv["process"]), ("node", sv["node"])] + ([("batch", sv["batch"])] if sv["batch"] is not None
                                                                   else [])
    return " ".join(f"{k} {'✓' if v else '✗'}" for k, v in said)
