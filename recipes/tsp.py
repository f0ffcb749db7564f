"""TSP (Shyam, Golubeva, Anthony 2026): weights *and* the sequence split over one axis
``tsp`` (8); weight shards circulate around a ring (the paper's schedules), ring attention.

Run: python recipes/tsp.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("tsp")
