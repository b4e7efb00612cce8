"""Where the checkout is, for tests that run its programs and read its files."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# recorded Slurm output and built command lines the launcher tests compare with (UPDATE_GOLDEN=1 rewrites)
GOLDEN = ROOT / "tests" / "launcher" / "golden"
