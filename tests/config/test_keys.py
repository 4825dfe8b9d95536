"""What defines an experiment is marked once, on the schema (gspo/config/schema.py), and each question's list is
derived from the markings (gspo/config/keys.py). These are the lists each question had before the markings, written
out: a marking changed by mistake changes one of them, and fails here."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from gspo.config import keys
from gspo.config.loading import compose
from gspo.config.schema import Config, ModelConfig, TaskConfig, leaf_keys
from tests.conftest import REPO, tiny

# A resume may change these (a key, or every key under a `x.` prefix), hardware.dtype excepted
RESUME_MAY_CHANGE = (
    "train.steps", "train.checkpoint_every", "train.keep_checkpoints", "eval.", "logger.", "hardware.",
    "task.eval_size", "rollout.mismatch_every", "moe.stats_every", "moe.stats_rows_per_group",
    "rollout.workers", "rollout.worker_threads", "rollout.timeout_s", "model.gradient_checkpointing",
    "model.attn_implementation", "model.lora.save_merged", "name", "cache_dir", "resume", "force_resume",
)
RESUME_KEEPS = ("hardware.dtype",)
# `gspo compare` takes runs that differ in these alone for one arm (`key.startswith` any of them)
COMPARE_IGNORES = (
    "seed", "name", "resume", "force_resume", "cache_dir", "run_dir", "output_dir", "logger.", "eval.",
    "hardware.name", "hardware.device", "hardware.nproc", "hardware.backend", "hardware.strategy", "hardware.threads",
    "hardware.compile", "hardware.collective_timeout_s",
    "model.name", "model.attn_implementation", "model.experts_implementation", "model.gradient_checkpointing",
    "rollout.engine", "rollout.mismatch_every", "rollout.workers", "rollout.worker_threads", "rollout.timeout_s",
    "moe.stats_every", "moe.stats_rows_per_group", "train.checkpoint_every", "train.keep_checkpoints",
    "reward.timeout_s", "rollout.tool_timeout_s", "rollout.vllm.",
)
# the warm-started base depends on every model.* and task.* key but these, and on these rollout keys
BASE_IGNORES = ("model.name", "model.gradient_checkpointing", "model.attn_implementation",
                "model.experts_implementation", "model.lora.", "task.eval_size")
BASE_READS = ("rollout.max_new_tokens", "rollout.tools", "rollout.max_turns")

LEAVES = leaf_keys()
NODES = sorted({k[: i + 1] for k in LEAVES for i, c in enumerate(k) if c == "."})  # `hardware.`, `model.lora.`, ...
OLDER = ["hardware.gone", "logger.x.y", "eval.gone", "model.gone", "rollout.vllm.gone", "model.lora.gone", "gone"]


def _old_resume(key: str) -> bool:
    return key not in RESUME_KEEPS and any(key == m or (m.endswith(".") and key.startswith(m))
                                           for m in RESUME_MAY_CHANGE)


@pytest.mark.parametrize("key", LEAVES + NODES + OLDER)
def test_a_resume_may_change_what_it_could_before(key):
    from gspo.train.run.resume import may_change

    assert keys.resume_may_change(key) == may_change(key) == _old_resume(key)


def test_compare_ignores_what_it_did_before():
    from gspo.results.compare import IGNORED_KEYS

    assert sorted(IGNORED_KEYS) == sorted(COMPARE_IGNORES)
    for key in LEAVES:
        assert keys.separates_arms(key) == (not key.startswith(COMPARE_IGNORES)), key


def test_the_warm_started_base_depends_on_what_it_did_before():
    derived = keys.prefixes(lambda k: not keys.base_depends_on(k), ModelConfig, "model.")
    derived += keys.prefixes(lambda k: not keys.base_depends_on(k), TaskConfig, "task.")
    assert sorted(derived) == sorted(BASE_IGNORES)
    assert [k for k in LEAVES if keys.base_depends_on(k) and not k.startswith(("model.", "task."))] == list(BASE_READS)


def test_base_part_drops_a_node_whole_and_leaves_its_input_alone():
    values = {"name": "tiny", "hidden_size": 64, "lora": {"r": 8}, "warm_start": {"steps": 3}}
    assert keys.base_part("model", values) == {"hidden_size": 64, "warm_start": {"steps": 3}}
    assert values["lora"] == {"r": 8} and values["name"] == "tiny"


def test_the_warm_start_cache_key_follows_the_markings(cache_dir):
    from gspo.train.start.warm_start import _base_key

    key = _base_key(compose(tiny(cache_dir)))
    for same in ("model.gradient_checkpointing=true", "task.eval_size=50", "rollout.temperature=0.5"):
        assert _base_key(compose(tiny(cache_dir, **dict([same.split("=")])))) == key, same
    for other in ("rollout.max_new_tokens=6", "task.eval_fraction=0.2", "model.warm_start.lr=0.001"):
        assert _base_key(compose(tiny(cache_dir, **dict([other.split("=")])))) != key, other


def test_every_marking_is_one_the_schema_defines():
    """A misspelt marking (`{"runs": True}`) would mark nothing, silently."""
    known = {"run", "seed", "label", "resume", "base"}

    def used(node: type) -> set[str]:
        hints = typing.get_type_hints(node)
        return {m for f in dataclasses.fields(node) for m in [*f.metadata, *(
            used(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else ())]}

    assert used(Config) <= known


def test_the_contract_lists_what_a_resume_may_change():
    """docs/contracts.md's list of the keys a resume may change is the schema's, key for key."""
    import re

    text = (REPO / "docs" / "contracts.md").read_text()
    para = text[text.index("A resume continues the same experiment"):text.index("A different value for any other key")]
    listed = {k.removesuffix(".*").removesuffix("*") for k in re.findall(r"`([a-z_.*]+)`", para)}
    derived = set()
    for path in keys._marked():
        key = ".".join(path)
        if path and keys.resume_may_change(key) and not keys.resume_may_change(".".join(path[:-1])):
            derived.add(key)
    # the contract names a group by `group.*` with its one exception (`hardware.dtype`), and moe.stats_* its keys
    derived = {"moe.stats_" if k.startswith("moe.stats_") else k for k in derived}
    assert listed - {"hardware.dtype"} == derived
