"""Progress lines for long work (sweeps, calibrate): items done / total, elapsed time, ETA."""

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class Progress:
    """Counts finished items of ``total``; the ETA assumes the rest take the mean time so far."""

    total: int
    what: str = ""
    """Prefix naming the work, e.g. "calibrate"."""
    done: int = 0
    start: float = field(default_factory=lambda: time.time())

    def line(self, label: str) -> str:
        elapsed = time.time() - self.start
        eta = (_clock(elapsed / self.done * (self.total - self.done)) if self.done
               else "unknown")
        prefix = f"{self.what} " if self.what else ""
        return (f"[{prefix}{self.done}/{self.total}, {_clock(elapsed)} elapsed, ETA {eta}] "
                f"{label}")

    def advance(self, label: str, n: int = 1, stream: TextIO | None = None) -> str:
        """Count ``n`` more items done and print the line (default: to stderr)."""
        self.done += n
        text = self.line(label)
        print(text, file=stream or sys.stderr, flush=True)
        return text


def _clock(seconds: float) -> str:
    """``h:mm:ss`` (``m:ss`` under an hour)."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"
