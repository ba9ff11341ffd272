"""Progress bars for the CLI and the demo: a tqdm bar on stderr, or nothing.

Kept apart from :mod:`kvcodec.tools.cli` so that the demo (and any other tool)
can draw a bar without importing the command line.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import IO, Any

__all__ = ["Progress", "progress_enabled"]


def progress_enabled(flag: bool | None, stream: IO[str] | None = None) -> bool:
    """Whether to draw a bar: ``flag`` if given, else whether ``stream`` (stderr) is a terminal."""
    if flag is not None:
        return flag
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _tqdm() -> Any:
    """tqdm's bar class, or None when the optional dependency is missing."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with the cli extra
        return None
    return tqdm


class Progress:
    """A tqdm bar on stderr when enabled and installed, else a no-op.

    ``write`` prints a line without tearing the bar.
    """

    def __init__(self, total: int | None, desc: str, *, enabled: bool, unit: str = "blob") -> None:
        self._bar: Any = None
        bar_class = _tqdm() if enabled else None
        if bar_class is not None:
            self._bar = bar_class(
                total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True
            )

    @property
    def active(self) -> bool:
        """Whether a bar is being drawn."""
        return self._bar is not None

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` steps."""
        if self._bar is not None:
            self._bar.update(n)

    def set_description(self, desc: str) -> None:
        """Change the bar's label."""
        if self._bar is not None:
            self._bar.set_description(desc, refresh=False)

    def write(self, line: str, file: IO[str] | None = None) -> None:
        """Print ``line`` (to stdout by default) above the bar."""
        out = file if file is not None else sys.stdout
        if self._bar is not None:
            self._bar.write(line, file=out)
        else:
            print(line, file=out)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
