"""Chat messages to prompt text: the chat template, rendered on a worker thread by the routes that take
messages (chat completions, the Responses API, embeddings, /tokenize).

1. The template is the request's own only where the server trusts it (--trust-request-chat-template), else
   the server's (--chat-template), else the model's; a template that fails, loops past its time limit or
   is missing is a 400 naming what to change.
2. With continue_final_message the prompt ends right after the final (assistant) message's text, so the
   reply continues it.
3. Image parts reach the template as `{"type": "image"}` (`template_messages`); only the routes that take
   images (chat completions, the Responses API: server/openai/images.py) pass such messages in, the
   others refuse them by name.
"""

from __future__ import annotations

from jaxserve.errors import InvalidParameter
from jaxserve.multimodal.chat_parts import ImageSource, split_images
from jaxserve.text.chat_template import ChatTemplateError
from server.http.errors import APIError
from server.openai.protocol import ChatCompletionRequest
from server.serving.context import ServingContext


def template_messages(body: ChatCompletionRequest) -> tuple[list[dict], list[ImageSource]]:
    """(the messages as the chat template takes them, the images they carry, in order)."""
    try:
        return split_images([m.for_template() for m in body.messages])
    except InvalidParameter as e:
        raise APIError(400, str(e), param=e.param) from None


def render_chat(ctx: ServingContext, body: ChatCompletionRequest, messages: list[dict] | None = None) -> str:
    """The prompt text; `messages` from `template_messages` where the route takes images."""
    options = ctx.options
    if messages is None:
        messages, images = template_messages(body)
        if images:
            raise APIError(400, f"{images[0].field}: this route takes text only; images go to /v1/chat/completions "
                                f"and /v1/responses", param=images[0].field, code="unsupported_parameter")
    if body.chat_template is not None and not options.trust_request_chat_template:
        raise APIError(400, "request chat templates are disabled on this server (start it with "
                            "--trust-request-chat-template to allow them)", param="chat_template")
    template = body.chat_template or options.chat_template
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
