"""Data parallel (2) × tensor + sequence parallel (4): Megatron's usual layout.

Run: python recipes/dp_tp_sp.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("dp_tp_sp")
