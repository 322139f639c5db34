"""Helpers for the Gemma 4 E4B on small GPUs course.

Modules, one per concept the course teaches:
``models`` (where a checkpoint comes from), ``synthetic`` (random-weight checkpoints of the
real shapes), ``loading`` (quantization and PLE placement at load time), ``placement``
(device maps, the PLE offload, placement reports), ``memory`` (weight-size estimates),
``errors`` (the one exception family).
"""

__version__ = "0.1.0"
