"""Language models: local Qwen2 / Llama models from the bundled GGUF packages, run by certrag's own decode engine
(weights kept quantised, continuous batching; certrag.llm.engine), with exact token counts, and a client for any
OpenAI-compatible server."""

from certrag.llm.local import Generation, LocalLLM, PromptTooLong
from certrag.llm.models import BUNDLED_MODELS, MissingModel, converted_model_dir
from certrag.llm.openai_client import LLMHTTPError, OpenAIChatClient

__all__ = ["BUNDLED_MODELS", "Generation", "LLMHTTPError", "LocalLLM", "MissingModel", "OpenAIChatClient",
           "PromptTooLong", "converted_model_dir"]
