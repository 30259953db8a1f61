"""ParDNN: place the ops of a graph on K devices for a small makespan under memory caps.

Modules, one concept each: ``graph`` (the op graph), ``emulate`` (FIFO scheduler
emulation, memory peaks), ``io`` (JSON / authors' formats, placements), ``slicing``,
``mapping``, ``refine``, ``memory`` and ``pardnn`` (the partitioner itself).
"""
