"""String interning: label keys and values become small integer codes once, at decode time."""

from __future__ import annotations

import threading


class Interner:
    """A thread-safe, append-only table of strings. Code -1 means "absent"."""

    def __init__(self) -> None:
        self._codes: dict[str, int] = {}
        self._strings: list[str] = []
        self._lock = threading.Lock()

    def code(self, s: str) -> int:
        c = self._codes.get(s)
        if c is None:
            with self._lock:
                c = self._codes.get(s)
                if c is None:
                    c = len(self._strings)
                    self._strings.append(s)
                    self._codes[s] = c
        return c

    def find(self, s: str) -> int:
        """The code of `s` if it was ever interned, else -1 (never adds)."""
        return self._codes.get(s, -1)

    def string(self, code: int) -> str:
        return self._strings[code] if code >= 0 else ""

    def strings(self) -> list[str]:
        return self._strings

    def __len__(self) -> int:
        return len(self._strings)
