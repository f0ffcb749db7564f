"""Megatron tensor parallel: heads, MLP units and the vocabulary split over ``tensor``.

Column-parallel q/k/v and MLP-up, row-parallel attention-out and MLP-down,
vocab-parallel embedding and loss. Wire per layer: 2 all-reduces of b·s·h forward and 2
backward. Heads must divide by the tensor size.

Run: python recipes/tp.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("tp")
