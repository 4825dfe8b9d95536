"""Seeds of the run's random draws: each a function of the run's seed and a key (step, draw, prompt, purpose).

Every random draw of a run comes from a generator keyed so (sampling, minibatch shuffles, Clip-Cov's pick,
pass@k sampling), or from torch's global generator reseeded at each step: a run is a function of its seed
and config, the same whether it samples in the trainer's process or in worker processes, under any number
of ranks, and after a resume.
"""

from __future__ import annotations

import hashlib

import torch


def keyed_seed(*key, purpose: str) -> int:
    """A 63-bit seed that is a function of `purpose` and `key` alone (e.g. seed, step): never of a rank or a clock."""
    digest = hashlib.blake2b("-".join([purpose, *map(str, key)]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def keyed_generator(*key, purpose: str, device="cpu") -> torch.Generator:
    """A generator of its own for one use of randomness, seeded by `keyed_seed(*key, purpose=...)`.

    Every random draw of a run comes from such a generator (sampling, minibatch shuffles, Clip-Cov's
    pick, pass@k sampling) or from torch's global one reseeded at each step: a run is a function of
    its seed and config, and a resumed run draws what the uninterrupted one draws.
    """
    return torch.Generator(device=device).manual_seed(keyed_seed(*key, purpose=purpose))


def group_generator(seed: int, step: int, draw: int, prompt: int, device, purpose: str = "sample") -> torch.Generator:
    """A generator of one prompt group's own: keyed by (seed, step, draw, global prompt index), never by rank."""
    return keyed_generator(seed, step, draw, prompt, purpose=purpose, device=device)
