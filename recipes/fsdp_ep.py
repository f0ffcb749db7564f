"""Experts split over `expert` (all-to-all dispatch), the dense weights and all the
rest of the state FSDP over the same axis.

Trains moe-tiny (8 experts, top-2, a shared expert, on llama-tiny's trunk).

Run: python recipes/fsdp_ep.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("fsdp_ep", model="moe-tiny", seq=64)
