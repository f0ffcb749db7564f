"""FSDP over ``fsdp`` (2) × Megatron tensor parallel over ``tensor`` (4).

Memory per device 16Ψ/(F·T); FSDP traffic on Ψ/T plus the TP activation all-reduces.

Run: python recipes/fsdp_tp.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("fsdp_tp")
