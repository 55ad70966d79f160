"""Suite-wide settings. Triton kernels run under the interpreter on CPU-only
machines; the flag must be set before any kernel module is imported."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
