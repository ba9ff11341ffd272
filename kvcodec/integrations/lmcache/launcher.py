"""``kvcodec-lmcache``: LMCache's own CLI with the ``"kvcodec"`` serde registered first.

LMCache 0.5.6 has no plugin discovery for serdes (``--server-module`` loads
after storage is built), so the serde must be registered in the server
process before LMCache's CLI main runs. This launcher does exactly that and
hands every argument to ``lmcache``'s main unchanged::

    kvcodec-lmcache server --l1-size-gb 4 --eviction-policy LRU \\
      --l2-adapter '{"type": "fs", "base_path": "/var/cache/kv", "serde": {"type": "kvcodec", "head_dim": 128}}'
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Register the serde, then run ``lmcache`` with ``argv`` (default: this process's arguments)."""
    from . import serde

    serde.register()
    from lmcache.cli.main import main as lmcache_main

    lmcache_main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
