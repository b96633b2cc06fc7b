"""Every parallel layout of the tiny MoE against one process, checkpoints across layouts, faults.

The runner (:mod:`.run`, also a script) takes the world size, the backend and the layouts as
parameters; CI runs it on 2 gloo ranks, multi-GPU machines on 2-8 NCCL ranks unchanged.
"""
