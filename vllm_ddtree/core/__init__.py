"""The pure core of DDTree: nothing under this package imports vLLM.

Tree construction (``tree``), the per-step tree description the attention
kernels read (``tree_info``), node histories, paths and pruning
(``node_history``), the GDN tree recurrence and its commit (``gdn_tree``),
KV-compaction indices (``compaction``), the adaptive budget policy
(``budget``), one verification round (``round``), the shared counters
(``stats``) and the user options (``config``). They depend on torch, numpy
and pydantic only, so they can be read and tested without an engine;
``tests/test_core_boundary.py`` keeps it that way. The vLLM-facing glue sits
one level up, one module per vLLM seam.
"""
