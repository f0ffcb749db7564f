"""Test setup: 8 emulated CPU devices, as in CI, before any JAX computation.

The suite compiles at LLVM optimisation level 0 (``--xla_backend_optimization_level=0``,
here and in every process a test starts): what the compile-only tests read (the HLO,
XLA's buffer assignment and memory, the collectives) comes before LLVM and does not
change, while CPU compiles take about 40 % less time (tests/test_suite_setup.py checks
both claims' first half). Steps still run, a little slower.
"""

import os

LLVM_O0 = "--xla_backend_optimization_level=0"
if LLVM_O0 not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {LLVM_O0}".strip()

import shardkit as sk  # noqa: E402  (XLA reads its flags when the backend starts)

sk.emulate_devices(8)
