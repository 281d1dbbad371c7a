"""Export drafter heads to the checkpoint formats serving stacks load (``treespec export``).

``export_eagle3``: an eagle3 head as vLLM's EAGLE-3 draft (``LlamaForCausalLMEagle3``), exact.
``export_medusa``: medusa heads as vLLM's Medusa draft (``MedusaModel``), exact.
Each module's docstring maps every tensor and names what does not carry over (SGLang: refused).
"""

from treespec.export.eagle3 import SGLANG_MISMATCH, eagle3_config, eagle3_tensors, export_eagle3
from treespec.export.medusa import export_medusa, medusa_config, medusa_tensors

__all__ = ["SGLANG_MISMATCH", "eagle3_config", "eagle3_tensors", "export_eagle3", "export_medusa",
           "medusa_config", "medusa_tensors"]
