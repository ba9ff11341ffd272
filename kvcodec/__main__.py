"""``python -m kvcodec``: the command line (see :mod:`kvcodec.tools.cli`)."""

from __future__ import annotations

import sys
from pathlib import Path

__all__: list[str] = []


def _drop_checkout_root(path: list[str]) -> None:
    """Take a kvcodec checkout's root off ``path`` (``sys.path``).

    ``python -m`` puts the working directory first on ``sys.path``; in a checkout that folder also
    holds the Triton sources as a top-level ``kernels/`` (installed as ``kvcodec.kernels``), which
    would shadow the installed ``kernels`` that transformers imports (``quality --model``). The
    package itself is imported by then, so the entry is no longer needed.
    """
    checkout = Path(__file__).resolve().parents[1]
    if not (checkout / "kernels" / "launch.py").is_file():
        return  # an installed kvcodec: the working directory is the user's business
    path[:] = [p for p in path if Path(p or ".").resolve() != checkout]


if __name__ == "__main__":
    _drop_checkout_root(sys.path)
    from .tools.cli import main

    raise SystemExit(main())
