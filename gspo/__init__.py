"""gspo: an experiment runner for group-based RL fine-tuning of language models.

The parts, bottom to top; a module imports only from its own package or from a package
below it (tests/test_layout.py keeps this true):

  core      files written whole, with modes others can read: what every layer uses
  config    the typed schema, composing it with Hydra, checks that need only the config, errors
  tasks     tasks with verifiable answers, their verifiers, reward functions      } one level:
  algos     the equations: losses, advantages, KL, shaping, mismatch corrections  } none of them
  models    building and loading models, LoRA, MoE routing and replay, log-probs  } imports another
  rollout   sampling G completions per prompt: the decode loop, its engines, the sampler copy
  train     the loop and what it needs: set-up, warm start, checkpointer, evaluator, ranks, launcher, logging
  results   reading finished runs: `gspo eval`, `gspo compare`, statistics, tables, figures
"""
