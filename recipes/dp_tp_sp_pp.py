"""3D parallelism: 2 data replicas × 2 pipeline stages × tensor + sequence parallel over 2.

The layer stack is cut into stages over ``stage``; inside each stage XLA splits the
layers the Megatron way over ``tensor`` (and the activations between them along the
sequence); replicas over ``data``. The pipeline is manual over ``stage`` and ``data``
only.

Run: python recipes/dp_tp_sp_pp.py [--steps 20] [--microbatches 4] [--schedule gpipe]
"""

from common import train_pipelined_and_report

if __name__ == "__main__":
    train_pipelined_and_report("dp_tp_sp_pp", n_layers=4)
