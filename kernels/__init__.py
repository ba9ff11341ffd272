"""Triton kernels of kvcodec, installed as ``kvcodec.kernels``.

Importing this package does not import Triton; each kernel module does, and
is only loaded when the Triton backend is asked for.
"""

__all__: list[str] = []
