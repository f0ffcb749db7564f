"""Experts split over `expert` (all-to-all dispatch), each expert's MLP and the dense
layers Megatron tensor parallel over `tensor` (expert 4 x tensor 2 on 8 devices).

Trains moe-tiny (8 experts, top-2, a shared expert, on llama-tiny's trunk).

Run: python recipes/ep_tp.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("ep_tp", model="moe-tiny", seq=64)
