"""Tool calling: a request's tools checked (`spec`), rendered by the chat template (cbatch/tokenizer.py's
`encode_messages(tools=...)`, `messages`), forced with `tool_choice` (`choice`: an xgrammar structural tag), and
a completion parsed back into OpenAI's `tool_calls` (`formats`, `calls`). docs/tools.md. Imports nothing of
cbatch but the ground floor (cbatch/config.py)."""
from cbatch.tools.calls import ParsedCompletion, tool_call_id
from cbatch.tools.choice import tool_choice_constraint
from cbatch.tools.formats import FORMATS, ToolFormat, detect_format, tool_format
from cbatch.tools.messages import template_messages, tool_message_fields
from cbatch.tools.spec import TOOL_FIELDS, ToolFieldError, ToolSpec, tool_spec

__all__ = ["FORMATS", "TOOL_FIELDS", "ParsedCompletion", "ToolFieldError", "ToolFormat", "ToolSpec", "detect_format",
           "template_messages", "tool_call_id", "tool_choice_constraint", "tool_format", "tool_message_fields", "tool_spec"]
