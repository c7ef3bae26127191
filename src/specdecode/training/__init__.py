"""Small training steps that make model-based drafting work on a target never trained for it:
exit adapters for self-speculation, distilled draft models. Every trainer is bounded
(``--max-minutes``), resumable (``--resume``) and saves its result through
:mod:`specdecode.artifacts`, tied to the target's fingerprint.
"""
