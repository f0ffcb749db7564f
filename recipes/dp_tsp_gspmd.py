"""Data parallel (2) × TSP's layout by rules only (4).

Run: python recipes/dp_tsp_gspmd.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("dp_tsp_gspmd")
