"""Emulated CPU devices for developing sharded programs on one machine.

Example:
  >>> import shardkit as sk
  >>> devices = sk.emulate_devices(8)   # before any JAX computation
  >>> len(devices)
  8
"""

from __future__ import annotations

from collections.abc import Mapping

import jax

from shardkit.errors import DeviceError

#: For a process that compiles programs and never runs them (the planner's workers, the
#: test suite): LLVM's optimisation level acts after XLA's HLO passes and buffer
#: assignment, so memory and collectives are unchanged, and level 0 saves about 40 % of
#: a CPU compile (tests/test_devices.py compares both levels).
COMPILE_ONLY_XLA_FLAGS = "--xla_backend_optimization_level=0"


def compile_only_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with :data:`COMPILE_ONLY_XLA_FLAGS` added to its ``XLA_FLAGS``; set it
    before JAX's backend starts (for a child process: pass it as its environment).

    Example:
      >>> compile_only_env({"XLA_FLAGS": "--xla_dump_to=/tmp/x"})["XLA_FLAGS"]
      '--xla_dump_to=/tmp/x --xla_backend_optimization_level=0'
    """
    flags = env.get("XLA_FLAGS", "")
    if COMPILE_ONLY_XLA_FLAGS not in flags:
        flags = f"{flags} {COMPILE_ONLY_XLA_FLAGS}".strip()
    return {**env, "XLA_FLAGS": flags}


__all__ = ["COMPILE_ONLY_XLA_FLAGS", "compile_only_env", "emulate_devices"]


def emulate_devices(n: int) -> list[jax.Device]:
    """Make JAX expose ``n`` CPU devices and return them.

    Must run before the JAX backend starts (before the first array is made).
    Calling it again with the same ``n`` is harmless.

    Args:
      n: number of CPU devices, at least 1.

    Returns:
      The ``n`` CPU devices.

    Raises:
      DeviceError: ``n`` is not a positive integer, or the backend already started
        with a different number of CPU devices.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DeviceError(f"emulate_devices(n) needs a positive integer, got {n!r}.")
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # backend already up: fine if it has the count we want
    devices = jax.devices("cpu")
    if len(devices) != n:
        raise DeviceError(
            f"emulate_devices({n}): the JAX backend already started with {len(devices)} CPU "
            f"device(s), and the count cannot change afterwards.\n"
            f"Fix: call sk.emulate_devices({n}) right after `import shardkit`, before any "
            f"JAX computation, or set XLA_FLAGS=--xla_force_host_platform_device_count={n} "
            "before starting Python."
        )
    return devices
