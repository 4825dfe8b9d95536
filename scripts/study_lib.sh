# Shared by the study scripts (source it): resumable runs, one fixed directory each.
#
#   run_one LABEL DIR OVERRIDES...   skip DIR if its run finished, resume it from its last checkpoint,
#                                    or (no checkpoint yet) start it afresh with `gspo train OVERRIDES...`;
#                                    the log goes to $OUT/logs/<LABEL with spaces as dashes>.log
#   build_base OVERRIDES...          the warm-started base of that config, in one thread like the runs
#                                    (the thread count changes float rounding, hence the base)
# Reads OUT, EXTRA (overrides added to every run) and GSPO (the command) from the environment.

finished() {  # finished RUN_DIR: exit 0 when the run's summary says it finished
  python - "$1/summary.json" <<'PY'
import json, sys
try:
    sys.exit(0 if json.load(open(sys.argv[1])).get("status") == "finished" else 1)
except (OSError, ValueError):
    sys.exit(1)
PY
}

run_one() {
  local label=$1 dir=$2
  shift 2
  local log="$OUT/logs/${label// /-}.log"
  if finished "$dir"; then
    echo "skip  $label (finished)"
    return 0
  fi
  local cmd=(train "$@" hardware.threads=1 logger.progress=false "hydra.run.dir=$dir")
  if compgen -G "$dir/checkpoints/step_*/trainer_state.pt" >/dev/null; then
    echo "resume $label"
    cmd=(train "resume=$dir")  # the run's own config: continues after its last checkpoint
  else
    rm -rf "$dir"  # no checkpoint yet: start it again from scratch
    echo "start $label"
  fi
  # shellcheck disable=SC2086  # EXTRA and GSPO are word lists
  if $GSPO "${cmd[@]}" $EXTRA >>"$log" 2>&1; then
    echo "done  $label: $(grep -h 'held-out accuracy' "$log" | tail -1 || true)"
  else
    echo "FAILED $label (exit $?): see $log"
  fi
}

build_base() {
  # shellcheck disable=SC2086
  python -c 'import sys, torch; from gspo.config.loading import compose; from gspo.tasks import build_task; from gspo.train.warm_start import base_model
torch.set_num_threads(1); c = compose(sys.argv[1:]); print("base:", base_model(c, build_task(c.task), log=lambda m: None))' \
    "$@" $EXTRA
}

export -f finished run_one build_base
export OUT EXTRA GSPO
