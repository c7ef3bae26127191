"""specdecode: lossless speculative decoding behind one interface.

    import specdecode
    specdecode.generate(model, tokenizer, "prompt", method="suffix")
"""

from specdecode.api import Decoder, GenerationResult, generate, stream
from specdecode.draft import Draft
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams

__all__ = ["Decoder", "Draft", "GenerationResult", "SamplingParams", "SpecDecodeError",
           "generate", "stream"]
