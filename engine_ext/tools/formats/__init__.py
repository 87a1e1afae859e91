"""The tool-call formats of the model families the engine serves, in the order a chat
template is matched against them; the generic format takes any template without a
tools branch."""

from engine_ext.tools.formats.base import Choice, Function, Prepared, ToolFormat, pick_format
from engine_ext.tools.formats.generic import GenericFormat
from engine_ext.tools.formats.hermes import HermesFormat
from engine_ext.tools.formats.llama3 import Llama3JsonFormat
from engine_ext.tools.formats.mistral import MistralFormat

# Native formats first, by how specific their template's marks are; the fallback last.
FORMATS: tuple[type[ToolFormat], ...] = (MistralFormat, HermesFormat, Llama3JsonFormat, GenericFormat)

__all__ = ["FORMATS", "Choice", "Function", "Prepared", "ToolFormat", "pick_format"]
