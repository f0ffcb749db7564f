"""Context parallel over two axes: Ulysses over ``ulysses`` (2) × ring over ``sequence`` (4).

All-to-alls over ``ulysses`` turn each device's s/8 tokens of every head into its ring
rank's s/4 tokens of half the heads; ring attention over ``sequence`` attends them; the
output goes back the same way. Use when heads do not divide the whole context axis, or
when Ulysses' all-to-alls run on a fast link and the ring across slower ones.

Run: python recipes/cp_usp.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("cp_usp", seq=256, max_seq=256)
