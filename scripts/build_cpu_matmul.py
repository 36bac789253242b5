"""Builds the CPU matmul kernel (model/cpu_matmul.cc -> model/_cpu_matmul.so) against jaxlib's
FFI headers and the venv's MKL; `make venv` runs it. Without a C++ compiler or MKL it says why and
exits 0 (the CPU step then keeps XLA's matmuls), or 1 with --strict.

    python scripts/build_cpu_matmul.py [--strict]
"""

from __future__ import annotations

import sys

from model.cpu_matmul import main

if __name__ == "__main__":
    sys.exit(main())
