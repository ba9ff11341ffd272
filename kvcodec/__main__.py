"""``python -m kvcodec``: the command line (see :mod:`kvcodec.cli`)."""

from __future__ import annotations

from .tools.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
