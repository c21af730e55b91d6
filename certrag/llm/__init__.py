"""Language models: local transformers causal LMs from the bundled GGUF packages (converted once into
CERTRAG_HOME), with exact token counts, and a client for any OpenAI-compatible server."""

from certrag.llm.local import Generation, LocalLLM
from certrag.llm.models import BUNDLED_MODELS, converted_model_dir
from certrag.llm.openai_client import LLMHTTPError, OpenAIChatClient

__all__ = ["BUNDLED_MODELS", "Generation", "LLMHTTPError", "LocalLLM", "OpenAIChatClient", "converted_model_dir"]
