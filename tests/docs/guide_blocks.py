"""Reading the guide's marked code blocks: what tests/docs/test_guide_commands.py runs.

A fenced block of a tested page is preceded by one HTML comment (invisible on the site) that says what the
test does with it:

    <!-- guide: run -->                       run it (bash, `set -euo pipefail`; a python block: python) in the
                                              page's folder; it must exit 0
    <!-- guide: run expect="REGEX" ... -->    ... and its output (stdout and stderr) must match each REGEX
                                              (re.search, multi-line; several expect= allowed)
    <!-- guide: run background -->            start it and go on (a block ending in `&`): it must exit 0 by the end
                                              of the page or by the next `join`; its expect= are checked then
    <!-- guide: run wait="CONDITION" -->      first wait (up to 3 minutes) until the shell CONDITION holds: the
                                              test's stand-in for "once a few steps have run"
    <!-- guide: run join -->                  first wait for the background blocks to end (the page says `wait`)
    <!-- guide: file=NAME -->                 write the block to NAME in the page's folder (a script the page runs)
    <!-- guide: parse -->                     Slurm-only: every `elastic-launch`/`elastic` command line in it is
                                              parsed by the real argparse parsers (launcher.options, launcher.cli),
                                              and a `python examples/X.py` it runs must exist
    <!-- guide: skip reason="..." -->         not run, and why

Every ```bash, ```sh and ```python block of a tested page needs one; ```text blocks (output, trees) none.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

MARK = re.compile(r"<!--\s*guide:(.*?)-->", re.S)
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
NEEDS_MARK = {"bash", "sh", "shell", "console", "python", "py"}
KINDS = {"run", "file", "parse", "skip"}


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    kind: str = ""  # run, file, parse, skip ("" = no marker)
    background: bool = False
    join: bool = False
    wait: str | None = None
    file: str | None = None
    reason: str | None = None
    expect: list[str] = field(default_factory=list)

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _marker(text: str, block: Block) -> None:
    for token in shlex.split(text):
        key, _, value = token.partition("=")
        if key in ("run", "parse", "skip"):
            block.kind = key
        elif key == "file":
            block.kind, block.file = "file", value
        elif key == "background":
            block.background = True
        elif key == "join":
            block.join = True
        elif key == "wait":
            block.wait = value
        elif key == "expect":
            re.compile(value)
            block.expect.append(value)
        elif key == "reason":
            block.reason = value
        else:
            raise ValueError(f"{block.where()}: unknown guide marker word {token!r}")
    if block.kind not in KINDS:
        raise ValueError(f"{block.where()}: a guide marker needs run, file=NAME, parse or skip")
    if block.kind == "skip" and not block.reason:
        raise ValueError(f"{block.where()}: skip needs reason=\"...\"")


def blocks(path: Path, name: str) -> list[Block]:
    """The page's fenced blocks in order, each with the marker right before it (blank lines between allowed)."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        block = Block(page=name, line=text.count("\n", 0, m.start()) + 1, lang=m.group(1), code=m.group(2))
        before = text[:m.start()].rstrip()
        if before.endswith("-->"):
            mark = before[before.rfind("<!--"):]
            found = MARK.fullmatch(mark)
            if found:
                _marker(found.group(1), block)
        out.append(block)
    return out


def commands(code: str) -> list[list[str]]:
    """The command lines of a shell block as argv lists: backslash continuations joined, comments and
    `#SBATCH` lines dropped, a leading `exec` dropped; variables are left as written."""
    joined = re.sub(r"\\\n", " ", code)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        argv = shlex.split(line, comments=True)
        if argv and argv[0] == "exec":
            argv = argv[1:]
        if argv:
            out.append(argv)
    return out
