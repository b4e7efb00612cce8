"""What a migration record may claim about verification, for the tests that read history."""
from __future__ import annotations


def verification_told(m) -> bool:
    """A record's bit_exact says what was checked: true where bytes crossed between processes (every
    piece's digest compared at both ends, and equal), null where none did (nothing to compare)."""
    return m.bit_exact is (True if m.bytes_moved else None) and m.bytes_moved is not None
