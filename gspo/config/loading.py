"""Composing the config with Hydra (`compose`), loading a run's saved one (`load_run_config`), sweeps
and resume arguments; every problem a one-line `ConfigError` naming the key.

Both entry points run `gspo.config.checks.check_values` (what needs only the config); the check against
the other parts' registries is `gspo.train.preflight.check`.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Optional

from gspo.config.checks import check_values, run_config_file
from gspo.config.schema import (
    CONF_DIR,
    GROUPS,
    AlgoConfig,
    Config,
    HardwareConfig,
    LoggerConfig,
    ModelConfig,
    RewardConfig,
    TaskConfig,
    group_options,
    register_configs,
)
from gspo.core.errors import ConfigError


def _suffix(name: Optional[str]) -> str:
    return f"-{name}" if name else ""


def _every(steps: int, points: int) -> int:
    """An interval giving about `points` evaluations over `steps` steps (conf/config.yaml's eval.every)."""
    return max(1, round(int(steps) / int(points)))


def _share(total: int, fraction: float) -> int:
    """`fraction` of `total`, rounded down, at least 1: a length that scales with another (conf/algo/dapo.yaml's
    overlong buffer, 20% of rollout.max_new_tokens as in the DAPO paper)."""
    return max(1, int(int(total) * float(fraction)))


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("gspo.suffix"):
        OmegaConf.register_new_resolver("gspo.suffix", _suffix)
    if not OmegaConf.has_resolver("gspo.every"):
        OmegaConf.register_new_resolver("gspo.every", _every)
    if not OmegaConf.has_resolver("gspo.share"):
        OmegaConf.register_new_resolver("gspo.share", _share)
    if not OmegaConf.has_resolver("gspo.job_dir"):
        OmegaConf.register_new_resolver("gspo.job_dir", job_name)


def quote_tool_lists(overrides: list[str]) -> list[str]:
    """`rollout.tools=FILE.py:fn1,fn2` quoted for Hydra, which would read its comma as a sweep: a part without
    `:` (`fn2`) names no tool on its own, so such a value is one spec, never a choice between specs."""
    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        if (key.lstrip("+") == "rollout.tools" and eq and "," in value and value[:1] not in "[\"'"
                and not all(":" in part for part in value.split(","))):
            o = f"{key}='{value}'"
        out.append(o)
    return out


# Composed configs by their overrides, unresolved: a composition reads and merges every YAML it selects (~0.3 CPU-s),
# and a process that composes the same overrides again (a sweep's checks, the CLI's plan, the tests) gets a copy.
# Safe because what composition reads, conf/ and the schema, does not change while the process runs; interpolations
# (environment, job directory) are resolved later, on each copy.
_COMPOSED: dict[tuple[str, ...], Any] = {}


def compose(overrides: list[str] = ()) -> Any:
    """The composed, validated config for `overrides` (as `gspo train` would see it).

    Raises ConfigError with a message for people on any problem.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    _register_resolvers()
    overrides = quote_tool_lists(list(overrides))
    _check_group_choices(overrides)
    key = tuple(overrides)
    if key not in _COMPOSED:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
                composed = hydra_compose(config_name="config", overrides=overrides)
        except Exception as e:  # Hydra/OmegaConf errors: keep the one line that names the problem
            raise ConfigError(_explain(e)) from None
        finally:
            GlobalHydra.instance().clear()
        if len(_COMPOSED) >= 256:
            _COMPOSED.clear()
        _COMPOSED[key] = composed
    cfg = copy.deepcopy(_COMPOSED[key])  # the caller owns its copy: it may set values
    check_values(cfg)
    return cfg


def load_run_config(run_dir: str | Path, overrides: list[str] = ()) -> Any:
    """A run's saved config.yaml with `overrides` applied, typed by the schema and checked.

    GROUP=OPTION replaces the whole group by that option's composed node (`task=countdown`);
    KEY=VALUE sets one value (`task.eval_size=500`), after the group swaps. A key the saved
    config or an override names that the schema does not have is an error, except the keys
    gspo itself removed (REMOVED_KEYS), which an older run's config.yaml may still hold. A key an older
    config.yaml lacks whose default has changed since (CHANGED_DEFAULTS) takes the value that run ran with.
    """
    from omegaconf import DictConfig, OmegaConf

    path = run_config_file(run_dir)
    try:
        saved = OmegaConf.load(path)
    except Exception as e:  # not YAML, or not a mapping
        raise ConfigError(f"{path}: unreadable ({_explain(e)})") from None
    if not isinstance(saved, DictConfig):
        raise ConfigError(f"{path}: not a gspo config (a YAML mapping of keys)")
    _drop_removed_keys(saved, path)
    _fill_changed_defaults(saved)
    swaps = [o for o in overrides if o.partition("=")[0] in GROUPS]
    fresh = compose(swaps) if swaps else None
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), saved)
        for o in swaps:
            group = o.partition("=")[0]
            cfg[group] = fresh[group]
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([o for o in overrides if o not in swaps]))
    except Exception as e:  # an unknown key or a wrong type: the one line that names it
        raise ConfigError(_explain(e)) from None
    check_values(cfg)
    return cfg


# Keys gspo no longer has -> the key that replaced them. An old run's config.yaml still loads (the key
# is dropped, with a note when its value differed); on the command line the old key names its successor.
REMOVED_KEYS = {
    "eval.temperature": "rollout.temperature",  # pass@k samples at the temperature the policy is trained at
}


def _drop_removed_keys(saved: Any, path: Path) -> None:
    from omegaconf import OmegaConf

    for old, new in REMOVED_KEYS.items():
        parent, _, leaf = old.rpartition(".")
        node = OmegaConf.select(saved, parent) if parent else saved
        if node is None or leaf not in node:
            continue
        value = node.pop(leaf)
        if value != OmegaConf.select(saved, new):
            print(f"gspo: note: {path} sets {old}={value}, a key gspo no longer has; "
                  f"{new}={OmegaConf.select(saved, new)} is used instead", file=sys.stderr)


# Keys whose default changed -> the value a config.yaml without them ran with (written before the key existed, so
# before its new default): an old run resumes, is evaluated and is checked by a sweep's rerun as it ran, not as the
# default now runs.
CHANGED_DEFAULTS = {
    "train.shared_prefix": False,  # absent: written before the key existed, when every update's forward was plain
}


def _fill_changed_defaults(saved: Any) -> None:
    from omegaconf import OmegaConf

    for key, value in CHANGED_DEFAULTS.items():
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(saved, parent) if parent else saved
        if node is not None and leaf not in node:
            node[leaf] = value


def _choices(overrides: list[str]) -> list[list[str]]:
    """Each override's `key=value` per value it sweeps (one for a plain override), as Hydra's sweeper lists them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as e:
        raise ConfigError(f"cannot parse the overrides: {e}") from None
    choices = []
    for o in parsed:
        key = o.get_key_element()
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        choices.append([f"{key}={v}" for v in values])
    return choices


def sweep_combinations(overrides: list[str], limit: int = 256) -> list[list[str]]:
    """Expand Hydra sweep syntax (`algo=grpo,gspo seed=0,1`) into the jobs' override lists."""
    import itertools

    return [list(c) for c in itertools.islice(itertools.product(*_choices(overrides)), limit)]


def bare_key(override: str) -> str:
    """The key an override sets, without Hydra's `+`, `++`, `~` (`+experiment=x` -> `experiment`)."""
    return override.partition("=")[0].lstrip("+~")


def swept_keys(overrides: list[str]) -> list[str]:
    """The keys a sweep gives more than one value (`algo=grpo,gspo seed=0,1 train.steps=9` -> algo, seed)."""
    return [bare_key(c[0]) for c in _choices(overrides) if len(c) > 1]


JOB_NAME_MAX = 120  # characters; a longer name keeps its start and a hash of the whole


def job_name(task: Any, exclude: Any, num: Any) -> str:
    """A sweep job's directory name: its overrides but the `exclude`d keys, `key-value` joined by `+` in key order
    (`cell-grpo_R2+seed-0`), every other character outside [A-Za-z0-9._-] made `_`, so that the name is a path
    Hydra's override grammar, a shell and any filesystem take as it is (`resume=SWEEP/cell-grpo+seed-0`). With no
    override left, the job's number. conf/config.yaml's hydra.sweep.subdir (resolver `gspo.job_dir`) and the checks
    of `gspo train -m` name a job with this one function, so that running a sweep again finds its runs."""
    import hashlib
    import re

    skip = set(exclude or ())
    items = sorted((bare_key(o), o.partition("=")[2]) for o in task if "=" in o and bare_key(o) not in skip)
    if not items:
        return str(num)
    name = "+".join(re.sub(r"[^A-Za-z0-9._-]", "_", f"{k}-{v}") for k, v in items)
    if len(name) > JOB_NAME_MAX:
        name = f"{name[:JOB_NAME_MAX - 9]}-{hashlib.blake2b(name.encode(), digest_size=4).hexdigest()}"
    return name


# groups added to the config with a `+` rather than chosen in its defaults, and what one option of each is
ADDED_GROUPS = {"experiment": "a preset over several groups", "cell": "a study's treatment (conf/cell/*.yaml)"}


def _check_group_choices(overrides: list[str]) -> None:
    added = [o.lstrip("+").partition("=")[0] for o in overrides if o.lstrip("+").partition("=")[0] in ADDED_GROUPS]
    if added.count("cell") and added.count("experiment") and added.index("cell") < added.index("experiment"):
        raise ConfigError("+cell=... before +experiment=...: a cell changes the preset it is applied to, so write "
                          "+experiment=NAME first (Hydra applies them in command-line order)")
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if key in ADDED_GROUPS:  # added with a +: an experiment (conf/experiment/*.yaml), a cell (conf/cell/*.yaml)
            valid = ", ".join(group_options(key))
            if value not in group_options(key):
                raise ConfigError(f"+{key}={value}: no such {key}. Valid options: {valid}")
            if not o.startswith("+"):
                raise ConfigError(f"{o}: {ADDED_GROUPS[key]} is added to the config, not swapped in: write +{key}={value}")
        if key in GROUPS and value and value not in group_options(key):
            raise ConfigError(
                f"{key}={value}: no such option for '{key}'. Valid options: {', '.join(group_options(key))}"
            )


def _explain(e: Exception) -> str:
    import re

    msgs = [str(x) for x in (e, e.__cause__) if x is not None]
    text = "\n".join(msgs)
    m = re.search(r"Key '([^']+)' (?:is )?not in", text) and re.search(r"full_key: (\S+)", text)
    if m and m.group(1) in REMOVED_KEYS:
        return f"{m.group(1)}: no longer a key; use {REMOVED_KEYS[m.group(1)]}"
    if m:
        parent = m.group(1).rsplit(".", 1)[0] if "." in m.group(1) else ""
        return f"{m.group(1)}: unknown key.{_valid_keys(parent)}"
    m = re.search(r"Could not load '(hydra/launcher/[^']+)'", text)
    if m:
        return f"{m.group(1)}: the Hydra launcher plugin is not installed (pip install 'gspo[cluster]')"
    m = re.search(r"Could not find '([^']+)'", text)
    if m:
        group = m.group(1).rsplit("/", 1)[0]  # algo/gspoo -> algo; hydra/launcher/x -> hydra/launcher
        return f"{m.group(1)}: no such config. Valid options for '{group}': {', '.join(group_options(group))}"
    m = re.search(r"full_key: (\S+)", text)
    first = msgs[-1].strip().splitlines()[0]
    return f"{m.group(1)}: {first}" if m else first


def _valid_keys(parent: str) -> str:
    from omegaconf import OmegaConf

    node: Any = OmegaConf.structured(Config)
    try:
        for part in filter(None, parent.split(".")):
            node = node[part] if not OmegaConf.is_missing(node, part) else None
        keys = sorted(node.keys()) if node is not None else []
    except Exception:
        keys = []
    if not keys:  # a group node (algo, model, ...): its schema's fields
        schema = {"algo": AlgoConfig, "model": ModelConfig, "task": TaskConfig, "reward": RewardConfig,
                  "hardware": HardwareConfig, "logger": LoggerConfig}.get(parent)
        keys = sorted(OmegaConf.structured(schema).keys()) if schema else []
    return f" Valid keys under '{parent or 'the top level'}': {', '.join(keys)}" if keys else ""


def resume_target(overrides: list[str]) -> Optional[str]:
    """The run directory a `resume=DIR` override names (the last one wins, as in Hydra), or None."""
    values = [o.partition("=")[2] for o in overrides if o.partition("=")[0] == "resume"]
    return values[-1] if values and values[-1] not in ("", "null") else None


def resume_overrides(overrides: list[str]) -> list[str]:
    """The KEY=VALUE overrides a resume applies to the run's own config.yaml (`train.steps=400`).

    Resume continues the run's config: a group swap (`algo=grpo`), an added or removed key
    (`+key=v`, `~key`) would make it another run, so they are refused rather than ignored.
    Hydra's own settings (`hydra.*`, `hydra/...`) and `resume=` itself are left out.
    """
    kept = []
    for o in overrides:
        key = o.partition("=")[0]
        if key == "resume" or key.startswith(("hydra.", "hydra/")):
            continue
        if key.startswith(("+", "~")) or key in GROUPS or "/" in key:
            raise ConfigError(f"{o}: resume continues the run's own config (its config.yaml); only KEY=VALUE "
                              "overrides of its keys apply on resume (e.g. train.steps=400). Start a new run to change it")
        kept.append(o)
    return kept


def preset_summary(overrides: list[str], cfg) -> Optional[str]:
    """One or two lines saying what `+experiment=NAME` switched on beyond the defaults (None without a preset):
    the groups it picks, then the keys it sets, as the command line would set them."""
    presets = [o for o in overrides if o.lstrip("+").partition("=")[0] == "experiment"]
    if not presets:
        return None
    from omegaconf import OmegaConf

    plain = compose([o for o in overrides if o not in presets])
    a, b = _flat(OmegaConf.to_container(plain, resolve=True)), _flat(OmegaConf.to_container(cfg, resolve=True))
    groups = [g for g in ("algo", "model", "task", "reward", "hardware", "logger") if a.get(f"{g}.name") != b.get(f"{g}.name")]
    keys = [k for k in sorted(b) if a.get(k) != b.get(k) and k != "name" and not any(k.startswith(f"{g}.") for g in groups)]
    parts = [f"{g}={b[f'{g}.name']}" for g in groups] + [f"{k}={b[k]}" for k in keys]
    shown = parts[:14]
    more = f" and {len(parts) - len(shown)} more (gspo train --cfg job ... shows every key)" if len(parts) > len(shown) else ""
    return f"{presets[0]} sets {', '.join(shown)}{more}"


def _flat(node, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out
