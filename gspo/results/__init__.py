"""Results: reading run directories, `gspo eval` (held-out accuracy, pass@k), `gspo compare`
(grouping, statistics with confidence intervals, collapse detection), its tables and figures.

The top of the package: may import any part; nothing in gspo imports it.
"""
