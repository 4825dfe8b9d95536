"""Tasks with verifiable answers, their verifiers, and the rewards computed from them.

`base` holds what every task shares (Problem, Verdict, the Task protocol, the held-out split,
the registry), re-exported here; `arithmetic`, `reasoning`, `calculator`, `word_problems` and `data` register
the tasks; `rewards` turns verdicts (or a user's functions) into rewards; `timeouts` bounds untrusted
reward and verifier code; `answers` checks math answers, in `mathcheck`'s child process; `tools`
runs the functions a model calls in a rollout, in a child process of its own.
Imports only `gspo.config` and `gspo.core`.
"""

from __future__ import annotations

from gspo.core.errors import ConfigError
from gspo.tasks import arithmetic, calculator, data, reasoning, word_problems  # noqa: F401  (importing registers the tasks)
from gspo.tasks.base import (  # noqa: F401  (the package's API)
    TASKS,
    Problem,
    Task,
    Verdict,
    canonical,
    is_heldout,
    judge,
    register_task,
)


def build_task(cfg) -> Task:
    """Build the task named by `cfg.name` from its config node."""
    if cfg.name not in TASKS:
        raise ConfigError(f"task={cfg.name}: no such task. Valid: {', '.join(sorted(TASKS))}")
    return TASKS[cfg.name](cfg)
