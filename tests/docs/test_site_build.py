"""The user's guide builds with `mkdocs build --strict` (a broken link, anchor or API reference fails it), and
its generated reference pages carry what the code says: every command of the parsers, every table of the
schema. The docs extra is installed by scripts/install-test-deps.sh (make test); this test installs nothing."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT


def test_site_builds_strict_with_generated_reference(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        pytest.fail(f"{mkdocs} is missing: the docs extra is not installed (scripts/install-docs-deps.sh, which "
                    "scripts/install-test-deps.sh runs)")
    site = tmp_path / "site"
    r = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(site)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    cli = (site / "reference" / "cli" / "index.html").read_text()
    from launcher.cli import SUBCOMMANDS

    for name in SUBCOMMANDS:  # every subcommand has its section, with its usage line
        assert f'id="elastic-{name}"' in cli, name
        assert f"usage: elastic {name}" in cli, name
    assert "usage: elastic-launch" in cli and "--checkpoint-every" in cli
    from db.models import Base

    schema = (site / "reference" / "database" / "index.html").read_text()
    for table in Base.metadata.tables.values():
        assert f"<code>{table.name}</code>" in schema, table.name
        for col in table.columns:
            assert f"<code>{col.name}</code>" in schema, (table.name, col.name)
    api = (site / "reference" / "runtime-api" / "index.html").read_text()
    assert re.search(r"join\b", api) and "next_step" in api and "keep_stage_blocks" in api
