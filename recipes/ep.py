"""Expert parallel: the experts of each MoE layer split over `expert`, the rest data
parallel over it. Each layer sends its tokens to their experts with an all-to-all over
`expert` and brings the outputs home with another (inside `jax.shard_map`).

Trains moe-tiny (8 experts, top-2, a shared expert, on llama-tiny's trunk).

Run: python recipes/ep.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("ep", model="moe-tiny", seq=64)
