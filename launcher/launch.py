"""`elastic-launch`: placeholder until the launcher lands."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("elastic-launch: not built yet in this version", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
