"""Data parallel × pipeline: 2 stages, each replicated over 4 ``data`` devices.

The batch is split over ``data``; each stage's gradient is all-reduced over ``data``.

Run: python recipes/dp_pp.py [--steps 20] [--microbatches 4] [--schedule 1f1b|gpipe|interleaved]
"""

from common import train_pipelined_and_report

if __name__ == "__main__":
    train_pipelined_and_report("dp_pp", n_layers=4)
