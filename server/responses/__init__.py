"""OpenAI's Responses API (`/v1/responses`): its request bodies and their translation into a chat request
(`protocol.py`), the routes that run it through the chat route's code (`routes.py`), the output items and
stream events (`output.py`), and the store that `previous_response_id` reads (`store.py`)."""
