"""Test setup: 8 emulated CPU devices, as in CI, before any JAX computation."""

import shardkit as sk

sk.emulate_devices(8)
