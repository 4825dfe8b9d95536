"""Held-out evaluation: the split training never samples, scored greedy and with pass@k.

heldout.py (the problems, `evaluate`, pass@k, RUN_DIR/heldout.jsonl records; also what `gspo eval` and the warm
start use), evaluator.py (when the loop evaluates, across ranks).
"""
