"""Test-wide setup. Triton's interpreter must be chosen before triton is first imported, so the
Triton-backend tests can run on CPU tensors; the default backend on CPU stays the torch path."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
