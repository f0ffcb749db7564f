"""``--devices N``: emulated CPU devices by default, real accelerators when present."""

from __future__ import annotations

import argparse

import jax

from shardkit.errors import DeviceError

DEFAULT_CPU_DEVICES = 8


def add_devices_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        help=f"number of devices (default: all GPUs/TPUs, or {DEFAULT_CPU_DEVICES} emulated "
        "CPU devices on a machine without accelerators)",
    )


def select_devices(requested: int | None) -> list[jax.Device]:
    """Devices for a command; must run before JAX's backend starts.

    Raises:
      DeviceError: more devices asked for than the accelerators have, or ``n < 1``.
    """
    if requested is not None and requested < 1:
        raise DeviceError(f"--devices must be at least 1, got {requested}.")
    try:  # the CPU device count only; GPU/TPU backends ignore it
        jax.config.update("jax_num_cpu_devices", requested or DEFAULT_CPU_DEVICES)
    except RuntimeError:
        pass  # backend already started (shardkit used in-process): use what it has
    devices = jax.devices()
    if requested is not None and requested > len(devices):
        kind = "emulated CPU" if devices[0].platform == "cpu" else devices[0].platform.upper()
        raise DeviceError(
            f"--devices {requested}: only {len(devices)} {kind} device(s) are available. "
            f"Fix: pass --devices {len(devices)} or fewer."
        )
    return devices[:requested] if requested else devices
