"""ZeroPP (Tang et al. 2024): 2 pipeline stages × ZeRO-3 over 4 ``fsdp`` devices, no TP.

Each stage's parameters, gradients and Adam state are sharded over ``fsdp``; a stage's
weights are gathered once per scheduling unit of ``--unit`` micro-batches (default: once
per step) and their gradients reduce-scattered once.

Run: python recipes/zeropp.py [--steps 20] [--microbatches 4] [--unit 2]
"""

from common import train_pipelined_and_report

if __name__ == "__main__":
    train_pipelined_and_report("zeropp", n_layers=4)
