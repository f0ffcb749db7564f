"""Data parallel: every device holds the whole state and a slice of the batch.

Use when the model and Adam state fit one device. Memory per device 16Ψ bytes (f32
Adam); one gradient all-reduce per step, 2Ψ·4·(N−1)/N bytes per device.

Run: python recipes/dp.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("dp")
