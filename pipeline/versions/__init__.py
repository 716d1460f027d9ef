"""Weight versions for operators: the read model over the weights and serving-status logs
(``table``), the operator's actions as ``weights`` events (``actions``), and
``liverl versions`` (``commands``)."""
