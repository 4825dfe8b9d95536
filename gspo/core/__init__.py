"""The ground floor: what every layer above uses and nothing of gspo's own below it (files written whole, with
the modes others can read)."""
