"""Hybrid sharded data parallel: FSDP within ``fsdp`` (4), replicas over ``data`` (2).

Use when one FSDP group fits the model and links between groups are slower.

Run: python recipes/dp_fsdp.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("dp_fsdp")
