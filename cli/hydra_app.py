"""Hydra's entry point for `gspo train`: one job of a run or of a multirun sweep."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gspo.config import CONF_DIR, _register_resolvers, load_run_config, register_configs

register_configs()
_register_resolvers()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def hydra_train(cfg: DictConfig) -> float:
    from gspo import distributed
    from gspo.trainer import train

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    if cfg.resume:  # continue the stopped run in its own directory, with its own config
        run_dir = Path(cfg.resume)
        dotted = [o for o in hc.overrides.task if "." in o.split("=")[0]]  # e.g. train.steps=400
        cfg = load_run_config(run_dir, dotted)
        cfg.resume = str(run_dir)
    if distributed.needs_launch(cfg.hardware):  # hardware=cpu-ddp|gpu-ddp|gpu-fsdp: torchrun the workers, wait
        summary = distributed.launch(cfg, run_dir)
    else:  # one process, or a worker of a torchrun started by hand (every rank takes rank 0's directory)
        run_dir = distributed.shared_run_dir(run_dir, cfg.hardware)
        summary = train(cfg, run_dir)
    if not distributed.is_main_process():
        return float("nan")
    base, final = summary.get("base_accuracy"), summary.get("final_accuracy")
    if base is not None and final is not None:
        print(f"held-out accuracy: base {base:.1%} -> trained {final:.1%} ({100 * (final - base):+.1f} points)")
    print(f"run directory: {run_dir}")
    return final if final is not None else float("nan")
