"""Target models: SmolLM2 and the Qwen2.5-Coder pair from PyPI wheels, tiny random models.

    loader       ``load_target(name)``: GGUF from its wheel -> HF model, dtype, packing, EOS ids
    gguf_parts   GGUFs split over several wheels: assembled in order, sha256 checked
"""

from treespec.targets.loader import Target, load_target

__all__ = ["Target", "load_target"]
