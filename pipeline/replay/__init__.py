"""Replay and namespaces: a second pipeline on the same cluster, fed with recorded traffic.

``namespace`` maps a namespace onto topics, groups and local state; ``replay`` copies live
(or archived) records into it; ``diff`` compares its rewards with the live ones; ``commands``
holds ``liverl replay``, ``liverl diff-rewards`` and ``liverl drop-namespace``.
"""
