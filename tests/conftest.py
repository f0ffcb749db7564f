"""Test setup: 8 emulated CPU devices, as in CI, before any JAX computation.

The suite compiles at LLVM optimisation level 0 (``shardkit.devices.compile_only_env``,
here and in every process a test starts): what the compile-only tests read (the HLO,
XLA's buffer assignment and memory, the collectives) comes before LLVM and does not
change (tests/test_devices.py compares both levels), while CPU compiles take about 40 %
less time. Steps still run, a little slower.
"""

import os

import shardkit as sk
from shardkit.devices import compile_only_env

os.environ.update(compile_only_env(os.environ))  # before the backend starts
sk.emulate_devices(8)
