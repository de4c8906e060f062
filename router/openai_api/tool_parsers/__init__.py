"""Tool-call syntaxes of the models that emit their own calls, for ``tool_choice: "auto"`` (vLLM's
``--tool-call-parser``): the reply is free text, and these find the calls in it.

Life cycle: one parser per choice of a reply (``tool_calls.ToolCallOutput`` makes it), fed the
reply's text as it arrives (``feed(text, finished)`` -> the calls completed by it, and content):
each call is returned once it is complete, and the text around the calls as content, held back
only while it could still be the start of a call. The whole reply is the same feed, finished at
once, so a stream and a body always agree. A call that does not parse is left in the content as
the model wrote it, so nothing generated is lost. A parser whose syntax starts with a special
token says so (``keeps_special_tokens``): the request then keeps special tokens in its text.

One module per syntax: ``hermes``, ``llama3_json``, ``mistral``, ``pythonic`` (their docstrings
give the syntax); ``common`` holds what they share.
"""

from router.openai_api.tool_parsers.common import ObjectScan, ParsedCall
from router.openai_api.tool_parsers.hermes import HermesParser
from router.openai_api.tool_parsers.llama3_json import Llama3JsonParser
from router.openai_api.tool_parsers.mistral import MistralParser
from router.openai_api.tool_parsers.pythonic import PythonicParser

PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
           "pythonic": PythonicParser}

__all__ = ["PARSERS", "HermesParser", "Llama3JsonParser", "MistralParser", "ObjectScan", "ParsedCall",
           "PythonicParser"]
