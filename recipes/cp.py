"""Context parallel: every sequence split over ``sequence`` (8), ring attention.

K/V blocks travel around the ring (N−1 permutes of b·(s/N)·h per layer), causal work
balanced by a zigzag layout; no device holds a [seq, seq] score matrix. Use for long
sequences.

Run: python recipes/cp.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("cp", seq=512, max_seq=512)
