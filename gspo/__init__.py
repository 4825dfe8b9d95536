"""gspo: an experiment runner for group-based RL fine-tuning of language models.

The parts, bottom to top; a module imports only from its own package or from a package
below it (tests/contracts/test_layout.py keeps this true, and the floors inside rollout/ and train/):

  core      what every layer uses: errors, processes' lifetime, files written whole, the build-once cache
            and its content hashes, the run's provenance (the machine), the authenticated network channel
  config    the typed schema, composing it with Hydra, checks that need only the config
  tasks     tasks with verifiable answers, their verifiers, reward functions      } one level:
  algos     the equations: losses, advantages, KL, shaping, mismatch corrections  } none of them
  models    building and loading models (GGUF copies, MoE splits), LoRA, routing  } imports another
  rollout   sampling G completions per prompt: decoding/, the inference engine/, child processes/, batches
  train     a run: its files and resume (run/), ranks/, held-out evaluation/, its starting model (start/),
            the loop/, and preflight (what is refused before work starts)
  results   reading finished runs: `gspo eval`, `gspo compare`, statistics, tables, figures
"""
