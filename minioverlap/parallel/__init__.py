# >>> ch20 file: tensor parallelism over several devices
"""Tensor parallelism: one model cut across several devices, each process holding one rank's shard."""
