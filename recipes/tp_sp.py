"""Tensor + sequence parallel (Megatron-SP): as ``tp``, with LayerNorm and residual
regions split along the sequence.

Activation memory per layer sbh(34/t + 5as/(ht)) instead of sbh(10 + 24/t + 5as/(ht));
each all-reduce becomes a reduce-scatter + all-gather of the same volume.

Run: python recipes/tp_sp.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("tp_sp")
