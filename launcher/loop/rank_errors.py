"""A restart-mode world's first failure, as torchrun reports it: every worker has its own
TORCHELASTIC_ERROR_FILE (launcher.runtime.torchrun_exec), where torch.distributed.elastic's `@record`
writes the exception and traceback of a rank that fails; the launcher reads them when workers die and
names the first failure (the earliest timestamp: the root cause, not the ranks that failed after it)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RankFailure:
    rank: int
    message: str  # the exception, one line
    traceback: str
    timestamp: int

    def line(self, node: str) -> str:
        return f"first failure: rank {self.rank} on {node}: {self.message}"


def read_failure(rank: int, path: Path) -> RankFailure | None:
    """The failure `@record` wrote for `rank` at `path`, None when there is none (or it is unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    message = data.get("message", {})
    if isinstance(message, str):  # a program that wrote its own error file: torch accepts a plain message
        return RankFailure(rank, message.strip().splitlines()[-1] if message.strip() else "", message,
                           int(data.get("timestamp", 0)))
    info = message.get("extraInfo", {})
    text = str(message.get("message", ""))
    return RankFailure(rank, text.strip().splitlines()[-1] if text.strip() else "", str(info.get("py_callstack", "")),
                       int(info.get("timestamp", 0)))


def first_failure(error_dir: Path) -> RankFailure | None:
    """The earliest failure among the world's ranks (ties: the lowest rank), None when no rank wrote one."""
    found = [f for p in sorted(Path(error_dir).glob("rank-*/error.json"))
             if p.parent.name[len("rank-"):].isdigit()
             and (f := read_failure(int(p.parent.name[len("rank-"):]), p)) is not None]
    return min(found, key=lambda f: (f.timestamp, f.rank), default=None)
