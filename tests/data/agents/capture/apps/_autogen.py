"""The AutoGen model client every AutoGen capture app uses: the stock
OpenAIChatCompletionClient, configured only with the recorder's tag URL, the model name
and the brief's sampling settings."""

from __future__ import annotations

from autogen_core.models import ModelInfo
from autogen_ext.models.openai import OpenAIChatCompletionClient

from _common import API_KEY, MAX_TOKENS, MODEL, TEMPERATURE

# AutoGen needs a ModelInfo for a model that is not one of OpenAI's. family "unknown" is
# the truth, and makes AutoGen send its selector prompt as a user message, as it does
# for every non-OpenAI model.
SMOLLM2_INFO = ModelInfo(vision=False, function_calling=True, json_output=False, family="unknown",
                         structured_output=False, multiple_system_messages=False)


def model_client(base_url: str, max_tokens: int = MAX_TOKENS) -> OpenAIChatCompletionClient:
    return OpenAIChatCompletionClient(model=MODEL, base_url=base_url, api_key=API_KEY, model_info=SMOLLM2_INFO,
                                      temperature=TEMPERATURE, max_tokens=max_tokens)
