"""The LangChain chat model the LangGraph capture apps use: the stock ChatOpenAI,
configured only with the recorder's tag URL, the model name and the brief's sampling."""

from __future__ import annotations

from langchain_openai import ChatOpenAI

from _common import API_KEY, MAX_TOKENS, MODEL, TEMPERATURE


def chat_model(base_url: str) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=base_url, api_key=API_KEY, temperature=TEMPERATURE,
                      max_tokens=MAX_TOKENS)
