"""A non-editable install serves the dashboard: the wheel carries the templates and static files.

Built from a copy of the checkout (so the build leaves nothing in it) without build isolation, and
installed with `pip install --no-deps --target`; a fresh interpreter that imports the project only
from there renders the login page and imports every package of the checkout (a package missing from
pyproject.toml's list, e.g. launcher.runtime, fails here). (A full `pip install .` into a fresh virtual environment, torch
included, was checked by hand; it takes about a minute.)
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.paths import ROOT
SKIP = shutil.ignore_patterns(".git", ".venv", "var", "build", "*.egg-info", "__pycache__", ".pytest_cache",
                              ".hypothesis", "node_modules")

CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import dashboard.app
from dashboard.app import create_app
assert dashboard.app.__file__.startswith(sys.argv[1]), dashboard.app.__file__
app = create_app({"DB_URL": "sqlite:///" + sys.argv[2], "SECRET_KEY": "k" * 40, "TESTING": True})
client = app.test_client()
page = client.get("/login")
assert page.status_code == 200 and b"password" in page.data, page.status_code
assert client.get("/static/style.css").status_code == 200
print("ok", dashboard.app.TEMPLATES)
import importlib
for name in sys.argv[3].split(","):  # every package of the checkout, from the wheel's copy
    mod = importlib.import_module(name)
    assert mod.__file__.startswith(sys.argv[1]), (name, mod.__file__)
"""


def test_wheel_serves_the_dashboard(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("elastic_launch-*.whl")
    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                   capture_output=True, timeout=120)
    assert (target / "dashboard" / "templates" / "base.html").is_file()
    packages = sorted(".".join(f.parent.relative_to(src).parts) for top in ("launcher", "migrate", "dashboard", "db")
                      for f in (src / top).rglob("__init__.py"))
    out = subprocess.run([sys.executable, "-I", "-c", CHECK, str(target), str(tmp_path / "e.db"), ",".join(packages)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert str(target / "dashboard" / "templates") in out.stdout
