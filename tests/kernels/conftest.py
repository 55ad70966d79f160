"""Kernel tests run the Triton kernels on CPU under the Triton interpreter. The flag must
be in the environment before triton is imported anywhere (it is read when kernels are
decorated), so it is set here, at conftest import time."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
