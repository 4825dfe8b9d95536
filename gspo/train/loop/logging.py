"""Metrics sinks: `metrics.jsonl` always, a Weights & Biases run when asked.

One `MetricsLogger.log(metrics, step)` call writes the same keys to both sinks,
so the local file and the W&B history never disagree. The file is the source
of truth (`gspo compare` reads it): one JSON object per call, flushed at once,
NaN/inf written as JSON's NaN/Infinity so a diverged run is visible, not lost.

W&B is imported only when `logger.wandb` is true. Offline mode (the default)
writes under RUN_DIR/wandb/ and needs no account; the `wandb sync` command
that uploads it later is printed once at the end (by W&B, or by `close()` when
W&B is silenced).

Held-out outcomes: a `log` call whose metrics carry an evaluation's outcome record
(under `gspo.train.evaluation.heldout.HELDOUT`, from the evaluator) appends it, with the step,
to RUN_DIR/heldout.jsonl; it is left out of metrics.jsonl and W&B.

Resuming: pass the checkpoint's step as `resume_step`; lines logged after it
(by the run that crashed) are dropped from metrics.jsonl, samples.jsonl and
heldout.jsonl before appending, and the W&B run continues under the id kept in
RUN_DIR/wandb_id.txt.
"""

from __future__ import annotations

import json
import secrets
import string
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf

from gspo.config.schema import LoggerConfig
from gspo.core.files import replace_text
from gspo.train.evaluation.heldout import HELDOUT, HELDOUT_FILE

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
WANDB_ID_FILE = "wandb_id.txt"


def _scalar(value: Any) -> Any:
    """A JSON-able python number from a float, int, bool, numpy or 0-d torch value."""
    if hasattr(value, "item"):  # numpy scalar / 0-d array, torch tensor
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return float(value)


def _json(value: Any) -> Any:
    """A value as plain JSON: numbers, strings, lists and objects (chat messages stay a list of objects)."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or (isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray))):
        return [_json(v) for v in value]
    return str(value)


def _cell(value: Any) -> Any:
    """A W&B table cell: numbers stay numbers, lists and objects become their JSON text, the rest text."""
    value = _json(value)
    return value if value is None or isinstance(value, (str, int, float, bool)) else json.dumps(value)


def truncate_jsonl(path: Path, last_step: int) -> int:
    """Keep only the lines of a JSONL file whose "step" is <= last_step.

    Unreadable lines (a half-written last line after a crash) are dropped too.
    The file is replaced atomically. Returns the number of lines dropped.
    """
    if not path.exists():
        return 0
    kept, dropped = [], 0
    with path.open() as fh:
        for line in fh:
            try:
                record = json.loads(line)
                keep = int(record["step"]) <= last_step
            except (ValueError, KeyError, TypeError):
                keep = False
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    replace_text(path, "".join(kept))
    return dropped


def _new_wandb_id() -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def hydra_sweep_group() -> str | None:
    """The Hydra sweep directory's name when called inside a multirun job, else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            return Path(hc.sweep.dir).name
    except Exception:  # not inside a Hydra app (tests, scripts): no group
        return None
    return None


class MetricsLogger:
    """Writes step metrics to RUN_DIR/metrics.jsonl and, optionally, to W&B.

    Call `close()` from a `finally` (or use it as a context manager) so the W&B
    run is finished even when training fails. In multi-process training only
    rank 0 should create one.
    """

    def __init__(
        self,
        run_dir: Path | str,
        cfg: DictConfig | Mapping[str, Any],
        resume_step: int | None = None,
        group: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if isinstance(cfg, DictConfig):
            self.config: dict = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
        else:
            self.config = dict(cfg)
        # Defaults come from the schema, so a partial `logger` section is fine.
        self.logger_cfg: LoggerConfig = OmegaConf.merge(  # type: ignore[assignment]
            OmegaConf.structured(LoggerConfig), self.config.get("logger") or {}
        )
        self.metrics_path = self.run_dir / METRICS_FILE
        self.samples_path = self.run_dir / SAMPLES_FILE
        self.heldout_path = self.run_dir / HELDOUT_FILE
        if resume_step is not None:
            for path in (self.metrics_path, self.samples_path, self.heldout_path):
                truncate_jsonl(path, resume_step)
        self._metrics_fh = self.metrics_path.open("a")
        self._samples_fh = None
        self._heldout_fh = None
        self.wandb_run = None
        self._closed = False
        wcfg = self.logger_cfg.wandb_cfg
        if self.logger_cfg.wandb and wcfg.mode != "disabled":
            try:
                self._init_wandb(group, resuming=resume_step is not None)
            except BaseException:
                self._metrics_fh.close()
                raise

    # -- W&B -----------------------------------------------------------------
    def _init_wandb(self, group: str | None, resuming: bool) -> None:
        try:
            import wandb
        except ImportError as e:  # pragma: no cover - depends on the install
            from gspo.core.errors import ConfigError

            raise ConfigError(
                "logger.wandb=true but the `wandb` package is not installed: "
                "pip install 'gspo[wandb]', or run with logger=jsonl."
            ) from e
        wcfg = self.logger_cfg.wandb_cfg
        id_file = self.run_dir / WANDB_ID_FILE
        if resuming and id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = _new_wandb_id()
            id_file.write_text(run_id + "\n")
        self.wandb_run = wandb.init(
            project=wcfg.project,
            entity=wcfg.entity,
            group=wcfg.group or group or hydra_sweep_group(),
            tags=list(wcfg.tags) or None,
            name=wcfg.name or self._default_run_name(),
            mode=wcfg.mode,
            dir=str(self.run_dir),
            config=self.config,
            id=run_id,
            resume="allow" if resuming else None,
        )

    def _default_run_name(self) -> str | None:
        """`<algo>-seed<seed>[-<name>]`, readable in a sweep's W&B group."""
        algo = (self.config.get("algo") or {}).get("name")
        if algo is None:
            return None
        name = f"{algo}-seed{self.config.get('seed', 0)}"
        return f"{name}-{self.config['name']}" if self.config.get("name") else name

    # -- sinks ---------------------------------------------------------------
    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Append {"step": step, **metrics} to metrics.jsonl (flushed) and log to W&B. None = not logged.
        An outcome record under `HELDOUT` goes to heldout.jsonl instead, {"step": step, **record}."""
        if metrics.get(HELDOUT) is not None:
            self.log_heldout(metrics[HELDOUT], step)
        record = {key: _scalar(value) for key, value in metrics.items() if value is not None and key != HELDOUT}
        record.pop("step", None)
        line = json.dumps({"step": int(step), **record}, allow_nan=True)
        self._metrics_fh.write(line + "\n")
        self._metrics_fh.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=int(step))

    def log_heldout(self, outcome: Mapping[str, Any], step: int) -> None:
        """One evaluation's outcome record (`gspo.train.evaluation.heldout.outcome_record`) as a line of heldout.jsonl,
        {"step": step, **outcome} (flushed: a crash keeps it)."""
        if self._heldout_fh is None:
            self._heldout_fh = self.heldout_path.open("a")
        self._heldout_fh.write(json.dumps({"step": int(step), **{k: _json(v) for k, v in outcome.items()}}) + "\n")
        self._heldout_fh.flush()

    def should_log_samples(self, step: int) -> bool:
        """Whether `log_samples(step, ...)` would write anything (skip building rows otherwise)."""
        every = self.logger_cfg.wandb_cfg.samples_every
        return every > 0 and step % every == 0

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Sample completions every `logger.wandb_cfg.samples_every` steps.

        Rows (e.g. {"prompt", "completion", "answer", "reward"}) go to
        RUN_DIR/samples.jsonl, one line each with its step, and, with W&B on,
        into a `samples` table. Other steps are ignored.
        """
        if not rows or not self.should_log_samples(step):
            return
        if self._samples_fh is None:
            self._samples_fh = self.samples_path.open("a")
        for row in rows:
            cells = {key: _json(value) for key, value in row.items()}
            self._samples_fh.write(json.dumps({"step": int(step), **cells}, allow_nan=True) + "\n")
        self._samples_fh.flush()
        if self.wandb_run is not None:
            import wandb

            columns = list(dict.fromkeys(key for row in rows for key in row))
            data = [[_cell(row.get(col)) for col in columns] for row in rows]
            self.wandb_run.log({"samples": wandb.Table(columns=columns, data=data)}, step=int(step))

    def close(self, exit_code: int = 0) -> None:
        """Close the files and finish the W&B run (exit_code != 0 marks it failed). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._metrics_fh.close()
        for fh in (self._samples_fh, self._heldout_fh):
            if fh is not None:
                fh.close()
        run, self.wandb_run = self.wandb_run, None
        if run is None:
            return
        offline = self.logger_cfg.wandb_cfg.mode == "offline"
        sync_dir = getattr(run.settings, "sync_dir", None) if offline else None
        # W&B prints its own `wandb sync` line on finish unless silenced (WANDB_SILENT / WANDB_QUIET)
        wandb_says_it = not (getattr(run.settings, "silent", False) or getattr(run.settings, "quiet", False))
        run.finish(exit_code=exit_code)
        if offline and not wandb_says_it:
            target = sync_dir or (self.run_dir / "wandb")
            print(f"W&B run saved offline; upload it with: wandb sync {target}", file=sys.stderr)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exit_code=0 if exc_type is None else 1)


class NullLogger:
    """The metrics sink of ranks other than 0: nothing is written."""

    def log(self, metrics, step: int) -> None:
        pass

    def log_heldout(self, outcome, step: int) -> None:
        pass

    def should_log_samples(self, step: int) -> bool:
        return False

    def log_samples(self, step: int, rows) -> None:
        pass

    def close(self, exit_code: int = 0) -> None:
        pass
