"""The README's Python examples run as written."""

from __future__ import annotations

import re
import sys

from tests.paths import REPO_ROOT

README = REPO_ROOT / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2
    saved = {k: v for k, v in sys.modules.items() if k == "lmcache" or k.startswith("lmcache.")}
    ns: dict = {}
    try:
        for code in blocks:
            exec(compile(code, str(README), "exec"), ns)
    finally:
        for k in [k for k in sys.modules if k == "lmcache" or k.startswith("lmcache.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    assert ns["v2"].shape == (2048, 8, 128)
