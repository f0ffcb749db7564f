"""``ep``'s layout by rules only: the experts and the batch split over `expert`, the
one-hot dispatch and combine einsums left to XLA (the baseline `ep` is measured
against).

Trains moe-tiny (8 experts, top-2, a shared expert, on llama-tiny's trunk).

Run: python recipes/ep_gspmd.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("ep_gspmd", model="moe-tiny", seq=64)
