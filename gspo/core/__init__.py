"""The ground floor: what every layer above uses, importing nothing of gspo's own from above it.

errors.py (ConfigError, RunFailed: the errors the CLI turns into one line), processes.py (a process gspo starts dies
with its parent), files.py (files written whole, with the modes others can read), cache.py (the build-once cache of
derived checkpoints and the content hashes it is keyed by), provenance.py (where a run ran: code, packages, machine),
channel.py (TCP connections whose peer proved it holds a key: `Gate`, `dial`).
"""
