"""ZeRO-1: parameters replicated, Adam moments sharded over ``data``.

Memory per device 4Ψ + 4Ψ + 8Ψ/N; wire as DP (2Ψ·4·(N−1)/N).

Run: python recipes/zero1.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("zero1")
