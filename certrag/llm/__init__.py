"""Language models: local transformers causal LMs from the bundled GGUF packages (converted once into
CERTRAG_HOME), with exact token counts."""

from certrag.llm.local import Generation, LocalLLM
from certrag.llm.models import BUNDLED_MODELS, converted_model_dir

__all__ = ["BUNDLED_MODELS", "Generation", "LocalLLM", "converted_model_dir"]
