"""A restart-mode world's first failure, as torchrun reports it: every worker has its own
TORCHELASTIC_ERROR_FILE (launcher.runtime.torchrun_exec), where torch.distributed.elastic's `@record`
writes the exception and traceback of a rank that fails; the launcher reads them when workers die and
names the first failure (the earliest timestamp: the root cause, not the ranks that failed after it).
A program without `@record` writes none: Python printed the traceback to the worker's output, so the
last one in the output files of the workers that failed (--log-dir) is read instead, the file written
last earliest standing for the first failure; torchrun shows its workers' stderr on the console too."""
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

    who: str = ""  # how the line names the rank, where the rank number alone would claim too much

    def line(self, node: str) -> str:
        return f"first failure: {self.who or f'rank {self.rank}'} on {node}: {self.message}"


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


TRACEBACK = "Traceback (most recent call last):"
TAIL_BYTES = 256 * 1024  # of an output file: a traceback is near its end


def logged_failure(rank: int, path: Path, who: str = "", since: int = 0) -> RankFailure | None:
    """The last traceback Python printed to the output file `path` of a failed worker after its first `since`
    bytes (what earlier worlds wrote: the files are appended to), header, frames, then the exception's line,
    timestamped by the file's last write; None when there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, 2) - TAIL_BYTES, since))
            text = f.read().decode(errors="replace")
        when = path.stat().st_mtime_ns
    except OSError:
        return None
    start = text.rfind(TRACEBACK)
    if start < 0:
        return None
    lines = text[start:].splitlines()
    end = next((i for i, x in enumerate(lines[1:], 1) if x and not x.startswith(" ")), len(lines) - 1)
    return RankFailure(rank, lines[end].strip(), "\n".join(lines[:end + 1]), when, who)
