"""OpenAI-compatible HTTP server over the jaxserve engine, in rooms whose imports only point down
(tests/test_import_graph.py holds them to this order, top first):

| room | what |
| --- | --- |
| `cli.py` | `jaxserve serve`: the subcommand and its options (the `jaxserve.commands` entry point) |
| `serve.py` | the process: listen, start the engine, run uvicorn, drain on SIGTERM, exit 1 if the engine fails |
| `app.py` | the app: the route table, middleware, the 404 and 500 answers; builds the serving context |
| `openapi.py` | `/openapi.json`, from the request bodies' pydantic models |
| `responses/` | OpenAI's Responses API, run through the chat route's code, and its response store |
| `openai/` | the OpenAI endpoints (completions, chat, embeddings, models) and vLLM's (tokenize, LoRA adapters) |
| `serving/` | the serving context every handler is given: engine client, served model, admission, metrics |
| `playground/` | the web page at `/` and `/playground` |
| `http/` | plumbing that knows no endpoint: guards, bodies, errors in OpenAI's shape, SSE, sockets |
| `options.py` | `ServerOptions`, the server's own settings |
| `replies/` | a choice's text as a client reads it: thinking, answer, tool calls |
| `tools/` | tool calling: the constraint of a `tool_choice`, the parsers of each model's call format |

A request's way through: the guard (http/guards.py), its handler (openai/ or responses/), which reads the
body into its pydantic model (http/bodies.py), prepares the prompts and has the engine check each once
(serving/engine_client.py) before any runs, then streams or collects the outputs.
"""
