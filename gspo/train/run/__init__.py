"""A run's files and its survival across interruptions: what is on disk, and what a stop, a failure or a resume
does with it.

rundir.py (the run directory, its lock, default names), checkpoint.py (the checkpoint format: save, find, load),
resume.py (what a resume may change, and its record), preemption.py (stop signals: finish the step, save, exit;
a requeued job resumed), failures.py (a failed rank's record in RUN_DIR/.failures/ and the one line explaining it),
sweep.py (a multirun's sweep.json and job names). When the loop saves is gspo/train/loop/checkpointer.py's.
"""
