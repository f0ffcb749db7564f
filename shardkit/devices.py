"""Emulated CPU devices for developing sharded programs on one machine.

Example:
  >>> import shardkit as sk
  >>> devices = sk.emulate_devices(8)   # before any JAX computation
  >>> len(devices)
  8
"""

from __future__ import annotations

import jax

from shardkit.errors import DeviceError

__all__ = ["emulate_devices"]


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
