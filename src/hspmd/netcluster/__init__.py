"""An emulated two-tier network on one machine: nodes as network namespaces (docs/netcluster.md).

``spec`` (pure): ``NetSpec`` and the ``ip``/``tc`` commands it implies; ``describe`` (pure):
the cluster file of a measured network; ``run``: builds, measures and removes it (root);
``measure``: the socket throughput tool run inside the namespaces.
"""
