"""Diffusion decoding policies, one file each (``diffusion/registry.py`` loads them)."""
