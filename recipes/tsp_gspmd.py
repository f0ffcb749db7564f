"""TSP's layout by rules only (8): XLA all-gathers each layer's weights over ``tsp``
(as FSDP), ring attention; the baseline for the paper's schedules (``tsp.py``).

Run: python recipes/tsp_gspmd.py [--steps 20] [--batch 8] [--seq N]
"""

from common import train_and_report

if __name__ == "__main__":
    train_and_report("tsp_gspmd")
