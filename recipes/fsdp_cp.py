"""FSDP over ``fsdp`` (4) × context parallel over ``sequence`` (2).

Run: python recipes/fsdp_cp.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("fsdp_cp", seq=256, max_seq=256)
