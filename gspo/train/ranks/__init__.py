"""More than one process training together (`hardware.nproc`): torch.distributed and its launcher.

distributed.py (`Dist`: a rank's place in the process group, DDP / FSDP2 wrapping, collectives, weights gathered),
launcher.py (torchrun inside the Hydra job; a failed rank said in one line: gspo/train/run/failures.py).
"""
