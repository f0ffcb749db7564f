"""Pipeline parallel: the layer stack cut into stages over ``stage`` (4 stages here).

Each stage holds L/p layers (parameters, gradients, Adam state); the batch is cut into
micro-batches that a schedule (gpipe, 1f1b, interleaved) moves through the stages.
Wire: one activation forward and one gradient backward per micro-batch between
neighbouring stages (collective-permutes). Bubble (p − 1)/(m + p − 1).

Run: python recipes/pp.py [--steps 20] [--microbatches 4] [--schedule 1f1b|gpipe|interleaved]
"""

from common import train_pipelined_and_report

if __name__ == "__main__":
    train_pipelined_and_report("pp", devices=4, n_layers=8)
