"""Doctests in shardkit/ run on 8 emulated CPU devices, like the test suite."""

import shardkit as sk

sk.emulate_devices(8)
