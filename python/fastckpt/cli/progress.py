"""Progress bars for the command line (tqdm), shown only on a terminal and only for large work.

:class:`Progress` is the callback the library layers take (``progress(done, total)``): it opens a tqdm bar on stderr
the first time it is called with work at least ``min_total`` large, and only when stderr is a terminal, so pipes,
logs and tests see no bar.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Progress", "BIG_BYTES"]

#: Byte totals from which verify and convert show a bar (256 MiB).
BIG_BYTES = 256 * 2**20


class Progress:
    """``progress(done, total)``: a tqdm bar of ``unit`` (``"B"`` or ``"files"``) titled ``desc``."""

    def __init__(self, desc: str, *, unit: str = "B", min_total: int = BIG_BYTES, stream: Any = None) -> None:
        self.desc, self.unit, self.min_total = desc, unit, min_total
        self.stream = stream if stream is not None else sys.stderr
        self.bar: Any = None
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.min_total:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, unit_scale=self.unit == "B",
                            unit_divisor=1024, file=self.stream, leave=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
