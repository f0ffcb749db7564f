"""FSDP (ZeRO-3): parameters, gradients and Adam state sharded over all devices.

Use when the state does not fit one device. Memory per device 16Ψ/N bytes of state;
wire 3Ψ·4·(N−1)/N (weights gathered forward and backward, gradients reduce-scattered).
The logits are split over the vocabulary like the tied embedding, so the embedding is
never gathered.

Run: python recipes/fsdp.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("fsdp")
