"""Chat messages to prompt text: the chat template, rendered on a worker thread by the routes that take
messages (chat completions, the Responses API, embeddings, /tokenize).

1. The template is the request's own only where the server trusts it (--trust-request-chat-template), else
   the server's (--chat-template), else the model's; a template that fails, loops past its time limit or
   is missing is a 400 naming what to change.
2. With continue_final_message the prompt ends right after the final (assistant) message's text, so the
   reply continues it.
"""

from __future__ import annotations

from jaxserve.text.chat_template import ChatTemplateError
from server.http.errors import APIError
from server.openai.protocol import ChatCompletionRequest
from server.serving.context import ServingContext


def render_chat(ctx: ServingContext, body: ChatCompletionRequest) -> str:
    options = ctx.options
    if body.chat_template is not None and not options.trust_request_chat_template:
        raise APIError(400, "request chat templates are disabled on this server (start it with "
                            "--trust-request-chat-template to allow them)", param="chat_template")
    template = body.chat_template or options.chat_template
    messages = [m.for_template() for m in body.messages]
    try:
        text = ctx.model.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, chat_template=template,
            time_limit=options.chat_template_timeout, **body.template_variables())
    except ChatTemplateError as e:
        raise APIError(400, f"chat template: {e}", param="messages", code="chat_template_error") from None
    except ValueError as e:  # no template at all
        raise APIError(400, f"chat template: {e}; start the server with --chat-template", param="messages") from None
    if body.continue_final_message:
        final = body.messages[-1].text
        cut = text.rfind(final) if final else -1
        if cut < 0:
            raise APIError(400, "continue_final_message: the chat template does not write the final message's "
                                "text as it is", param="continue_final_message")
        text = text[:cut + len(final)]
    return text
