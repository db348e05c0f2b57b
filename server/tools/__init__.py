"""Tool calling: the constraint a chat request's `tool_choice` imposes on the reply (`calls.py`), and the
tool calls read back out of a model's own format under vLLM's `--tool-call-parser` names (`parsers.py`,
over the strict, incremental JSON reader of `json_scan.py`)."""
