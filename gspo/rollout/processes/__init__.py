"""The processes gspo starts to sample for it, and those it connects to: the plumbing, not what they compute.

child.py: the trainer's end of a child process (`Child`: `python -m <module> FD` on a private socket pair; its
error, death or silence as one line), and what it shares with a connection to a process gspo did not start
(`Link`); peer.py: such a connection (`Peer`; `RemoteChild`, an engine `gspo vllm-serve` runs); serve.py: the child's
end (`serve`, its main loop; `Clients`, a shared engine's other ranks); shm.py: the /dev/shm segments a killed child
leaves, removed. Nothing here imports the rest of gspo.rollout.
"""
