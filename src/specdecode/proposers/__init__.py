"""Proposers: one method per file, each registered with :func:`specdecode.registry.register`.

Every module in this package is imported by the registry, so a new method is one new file.
"""
