"""Data parallel (2) × TSP (4): the paper's schedules within each TSP group.

Run: python recipes/dp_tsp.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("dp_tsp")
