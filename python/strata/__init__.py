"""Strata: memory offload for training large models on one machine.

    import strata.torch                      # PyTorch: DeepSpeed-style initialize(), CPUAdamW
    strata.version()                         # the C library's version string

The package drives the C library (libstrata.so, built and installed with the
package) through its C ABI with ctypes; see docs/python.md.
"""
from ._lib import StrataError, library_path

__all__ = ["StrataError", "library_path", "version"]


def version():
    """The C library's version string ("strata 0.1.0 (commit ...)")."""
    from . import _lib
    return _lib.strata_version().decode()
