"""Chat messages as vLLM's `LLM.chat` hands them to a chat template (its
`entrypoints/chat_utils.py`): a message's content, a string or a list of OpenAI content
parts (or None), becomes what the template reads. A template that loops over a message's
content reads parts ("openai"); any other reads one string, the text parts joined by
newlines ("string"). jaxvllm's models read text only, so other parts are refused.
"""

from __future__ import annotations

import json
from typing import Any

CONTENT_FORMATS = ("auto", "string", "openai")
# Part types whose text a template sees, and the key that holds it.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def detect_content_format(template: Any) -> str:
    """"openai" when the Jinja template loops over a message's content (`for part in
    message['content']`), else "string", as vLLM's `_detect_content_format` decides."""
    import jinja2
    from jinja2 import nodes

    if not isinstance(template, str):
        return "string"
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return "string"
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        if (isinstance(it, nodes.Getattr) and it.attr == "content") or (
                isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content"):
            return "openai"
    return "string"


def render_chat(tokenizer: Any, conversations: list[list[dict]], *, chat_template: str | None = None,
                content_format: str = "auto", add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> list[str]:
    """Each conversation as the text the chat template makes of it (`LLM.chat`'s rendering);
    `continue_final_message` leaves the last (assistant) message open for the model to go on."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=True needs add_generation_prompt=False")
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, got {content_format!r}")
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if template is None:
        raise ValueError("the tokenizer has no chat template; pass chat_template=")
    if content_format == "auto":
        content_format = detect_content_format(template)
    return [
        tokenizer.apply_chat_template(
            parse_conversation(conv, content_format), chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, tokenize=False,
            continue_final_message=continue_final_message, tools=tools, **(chat_template_kwargs or {}),
        )
        for conv in conversations
    ]


def parse_conversation(conversation: list[dict], content_format: str) -> list[dict]:
    """The messages as the template should get them (copies): content in `content_format`
    ("string" or "openai"), None as no text, and an assistant's tool-call arguments as
    dicts (vLLM's `_postprocess_messages`: templates read them as dicts, OpenAI sends JSON)."""
    parsed = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or "role" not in message:
            raise TypeError(f"message {i} must be a dict with a 'role', got {message!r}")
        message = dict(message)
        texts = _texts(message.get("content"), i)
        message["content"] = ("\n".join(texts) if content_format == "string"
                              else [{"type": "text", "text": text} for text in texts])
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and isinstance(calls, list):
            if not calls:
                del message["tool_calls"]  # (a template would take the tool-call path)
            else:
                message["tool_calls"] = [_with_dict_arguments(call) for call in calls]
        parsed.append(message)
    return parsed


def _texts(content: Any, i: int) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, (list, tuple)):
        raise TypeError(f"message {i}: content must be a str, a list of content parts or None, got {content!r}")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get(_TEXT_PARTS[kind]), str):
            raise ValueError(f"message {i}: content part {part!r} is not supported: jaxvllm's models read text "
                             f"parts only ({', '.join(_TEXT_PARTS)})")
        texts.append(part[_TEXT_PARTS[kind]])
    return texts


def _with_dict_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or isinstance(function.get("arguments"), (dict, list)):
        return call
    arguments = function.get("arguments")
    return {**call, "function": {**function, "arguments": json.loads(arguments) if arguments else {}}}
