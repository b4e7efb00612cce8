"""What a merge can leave behind unnoticed: a tracked file with git's conflict markers (the README's folder
table carried them for a whole session, and nothing that runs reads the README)."""
from __future__ import annotations

import re
import subprocess

from tests.paths import ROOT

MARKER = re.compile(rb"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def test_no_tracked_file_holds_conflict_markers() -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    marked = [f.decode() for f in files if f and (ROOT / f.decode()).is_file()
              and MARKER.search((ROOT / f.decode()).read_bytes())]
    assert not marked, f"conflict markers left by a merge in: {', '.join(marked)}"
