"""Chat messages as vLLM's `LLM.chat` hands them to a chat template (its
`entrypoints/chat_utils.py`): a message's content, a string or a list of OpenAI content
parts (or None), becomes what the template reads. A template that loops over a message's
content reads parts ("openai"); any other reads one string, the text parts joined by
newlines ("string"). jaxvllm's models read text only, so other parts are refused.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

CONTENT_FORMATS = ("auto", "string", "openai")
# Part types whose text a template sees, and the key that holds it.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}


def detect_content_format(template: Any) -> str:
    """"openai" when the Jinja template loops over a message's content, else "string", as
    vLLM's `_detect_content_format` decides: a message is the target of a loop over
    `messages` (or a name assigned from it), and its content may pass through filters,
    tests and slices (`for part in message['content'] | selectattr(...)`)."""
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    if not isinstance(template, str):
        return "string"
    try:  # (transformers' environment: its extensions, such as `{% generation %}`, parse)
        ast = _compile_jinja_template(template).environment.parse(template)
    except Exception:
        return "string"
    loops = [loop for loop in ast.find_all(nodes.For) if isinstance(loop.target, nodes.Name)]
    lists = _aliases(ast, "messages")
    messages = {loop.target.name for loop in loops if _reads(loop.iter, lists)}
    return "openai" if any(_reads(loop.iter, messages, "content") for loop in loops) else "string"


def _reads(node: Any, names: set[str], key: str | None = None) -> bool:
    """Whether `node` is one of `names` (with `key`: its `key` item), through filters, tests
    and slices."""
    from jinja2 import nodes

    while isinstance(node, (nodes.Filter, nodes.Test)) or (isinstance(node, nodes.Getitem)
                                                           and isinstance(node.arg, nodes.Slice)):
        node = node.node
    if key is not None:
        if not ((isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key)
                or (isinstance(node, nodes.Getattr) and node.attr == key)):
            return False
        node = node.node
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _aliases(ast: Any, name: str) -> set[str]:
    """`name` and the names assigned from it (or from its filtered or sliced value), and
    from those, in turn."""
    from jinja2 import nodes

    names, todo = {name}, [name]
    while todo:
        current = todo.pop()
        for assign in ast.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in names and _reads(assign.node, {current}):
                names.add(target.name)
                todo.append(target.name)
    return names


def render_chat(tokenizer: Any, conversations: list[list[dict]], *, chat_template: str | None = None,
                content_format: str = "auto", add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> list[str]:
    """Each conversation as the text the chat template makes of it (`LLM.chat`'s rendering);
    `continue_final_message` leaves the last (assistant) message open for the model to go on.
    As in vLLM, `chat_template_kwargs` win over the named arguments, and the template is the
    tokenizer's for the tools (a tokenizer may hold several by name); a template's error is
    a ValueError."""
    kwargs = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message, tools=tools)
    kwargs.update(chat_template_kwargs or {})
    if kwargs["continue_final_message"] and kwargs["add_generation_prompt"]:
        raise ValueError("continue_final_message=True needs add_generation_prompt=False")
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, got {content_format!r}")
    try:
        kwargs["chat_template"] = tokenizer.get_chat_template(kwargs["chat_template"], tools=kwargs["tools"])
    except ValueError as e:
        raise ValueError(f"the tokenizer has no chat template; pass chat_template= ({e})") from e
    if content_format == "auto":
        content_format = detect_content_format(kwargs["chat_template"])
    texts = []
    for k, conversation in enumerate(conversations):
        try:
            messages = parse_conversation(conversation, content_format)
            try:
                texts.append(tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))
            except Exception as e:  # (jinja2's TemplateError, say: vLLM's is a ValueError)
                raise ValueError(str(e)) from e
        except (TypeError, ValueError) as e:
            if len(conversations) > 1:
                e.add_note(f"(conversation {k} of {len(conversations)})")
            raise
    return texts


def parse_conversation(conversation: list[dict], content_format: str) -> list[dict]:
    """The messages as vLLM hands them to the template (new dicts): role, content in
    `content_format` ("string" or "openai"; None as no text; a tool's always a string), a
    string `name`, an assistant's tool calls (their JSON arguments as dicts, as templates
    read them: vLLM's `_postprocess_messages`) and `reasoning`, and a tool message's
    `tool_call_id`; other keys are dropped."""
    parsed = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or "role" not in message:
            raise TypeError(f"message {i} must be a dict with a 'role', got {message!r}")
        role, texts = message["role"], _texts(message.get("content"), i)
        # (a tool's result one string in either format, as newer vLLM's: templates read it so)
        as_string = content_format == "string" or role == "tool"
        out = {"role": role, "content": "\n".join(texts) if as_string else [{"type": "text", "text": text}
                                                                            for text in texts]}
        calls = message.get("tool_calls")
        if role == "assistant" and calls is not None:  # (an empty list kept, as vLLM's)
            out["tool_calls"] = [_with_dict_arguments(call) for call in calls]
        if role == "assistant" and message.get("reasoning") is not None:  # (newer vLLM's, under both names)
            out["reasoning"] = out["reasoning_content"] = message["reasoning"]
        if role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        parsed.append(out)
    return parsed


def _texts(content: Any, i: int) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        content = [content]
    if not isinstance(content, (list, tuple)):
        raise TypeError(f"message {i}: content must be a str, a list of content parts or None, got {content!r}")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "refusal") and part.get(kind) is None:
            logger.warning("message %d: skipping content part %r, which has no %s (as vLLM does)", i, part, kind)
            continue
        if kind not in _TEXT_PARTS or not isinstance(part.get(_TEXT_PARTS[kind]), str):
            raise ValueError(f"message {i}: content part {part!r} is not supported: jaxvllm's models read text "
                             f"parts only ({', '.join(_TEXT_PARTS)})")
        texts.append(part[_TEXT_PARTS[kind]])
    return [text for text in texts if text]  # (vLLM drops empty parts: "a", "", "b" is "a\nb")


def _with_dict_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or isinstance(function.get("arguments"), (dict, list)):
        return call
    arguments = function.get("arguments")
    return {**call, "function": {**function, "arguments": json.loads(arguments) if arguments else {}}}
