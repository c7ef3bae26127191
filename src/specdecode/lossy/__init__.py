"""Lossy methods: output that differs from ``ar``'s on purpose, for speed (docs/lossy.md).

Each one is a file here, citing its paper and stating its defaults, registered with
``lossy=True``. They do not fit the propose/verify loop (nothing is verified), so each runs a
decode loop of its own behind :class:`specdecode.lossy.base.LossyMethod`; ``engine.py`` knows
nothing of them.
"""
