"""Masked-diffusion decoding over the native runner: the block-diffusion forward
(``model.py``), the decode loop (``decode.py``) and its policies (``policies/``, one file each,
listed by ``registry.py``). docs/diffusion.md has the commands and the measurements."""
