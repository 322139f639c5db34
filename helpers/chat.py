"""Chat with Gemma 4 through transformers: messages checked, rendered by the checkpoint's own chat
template, streamed token by token into a notebook widget with a stop button, the history kept.

Gemma 4 speaks in turns: ``<|turn>user\\n ... <turn|>\\n``, the reply opens with ``<|turn>model\\n`` and
ends with the stop token ``<turn|>`` (``generation_config.eos_token_id`` lists it beside ``<eos>`` and, for a
turn that calls a tool, ``<|tool_response>``). With ``enable_thinking=True`` the template puts ``<|think|>``
in a system turn, and the model writes its thought as ``<|channel>thought\\n ... <channel|>`` before the
answer; earlier thoughts are not replayed.
"""

from __future__ import annotations

import gc
import hashlib
import html
import inspect
import json
import re
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
from packaging.version import Version

from . import loading
from .errors import (
    ChatMessageError,
    ChatTemplateError,
    CourseError,
    InsufficientGPUMemoryError,
    InvalidChoiceError,
    ReplyInProgressError,
    require_bool,
    require_choice,
    require_number,
    require_positive_number,
    require_tokenizer,
    require_whole_number,
)
from .placement import compute_device_of

loading.require_importable_transformers()  # one sentence, not a traceback from inside transformers' import
import transformers  # noqa: E402
from transformers import ProcessorMixin, StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer  # noqa: E402

ROLES = ("system", "developer", "user", "assistant", "tool")
INSTRUCTION_ROLES = ("system", "developer")  # Gemma 4's templates render a first developer message as the system turn
PLAIN_STRINGS = ("keep", "convert", "refuse")
# the keys a media part may carry its data under (transformers' processors read these)
MEDIA_KEYS = {"image": ("image", "url", "path", "base64"), "audio": ("audio", "url", "path"), "video": ("video", "url", "path")}
THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>", "<channel|>"
THINK_SWITCH = "<|think|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<|tool_call>", "<tool_call|>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<|tool_response>", "<tool_response|>"
TOOL_DECLARATION_OPEN = "<|tool>"
QUOTE = '<|"|>'  # how Gemma 4 writes the quotes around a string inside a declaration, a call or a response
# transformers 5.5-5.6's processors iterate a string content as if it were a list of parts when tokenizing
# (data/chat/plain-string-content.json); from 5.7 they accept it
PROCESSOR_TAKES_STRINGS = Version(transformers.__version__) >= Version("5.7.0")


def _text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def check_messages(messages, *, plain_strings: str = "keep") -> list[dict]:
    """A checked copy of ``messages``: roles known, content a string or a list of typed parts, tool calls
    and tool responses in the shape Gemma 4's template reads. A plain string is kept (the published
    templates render a string as it is), converted to ``[{"type": "text", "text": ...}]`` with
    ``plain_strings="convert"``, or refused with ``"refuse"``. A system or developer message whose parts are
    all text becomes one string: the April 2026 template writes a list there as Python text, later ones add
    a space. Every problem is one ``ChatMessageError`` sentence."""
    require_choice(plain_strings, PLAIN_STRINGS, "plain_strings")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatMessageError(
            f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, not {type(messages).__name__}: "
            f"start with [{{'role': 'user', 'content': 'Hello'}}].")
    checked = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or "role" not in message:
            raise ChatMessageError(f"{where} must be a dict with 'role' and 'content' keys, not {message!r}.")
        role = message["role"]
        if role not in ROLES:
            raise ChatMessageError(f"{where} has role {role!r}; Gemma 4's template knows {', '.join(map(repr, ROLES))}: "
                                   f"use 'assistant' for the model's turns (the template writes it as 'model').")
        calls = _checked_tool_calls(message.get("tool_calls"), where) if role == "assistant" else None
        if role == "tool":
            checked.append(_checked_tool_message(message, where, checked))
            continue
        if "content" not in message and not calls:
            raise ChatMessageError(f"{where} ({role}) has no 'content': add 'content': '...' "
                                   f"(only an assistant message with 'tool_calls' may go without).")
        copy = dict(message)
        if "content" in message and (calls is None or message["content"] not in (None, "", [])):
            copy["content"] = _checked_content(message["content"], where, role, plain_strings)
        if calls is not None:
            copy["tool_calls"] = calls
        checked.append(copy)
    return checked


def _checked_content(content, where: str, role: str, plain_strings: str):
    if isinstance(content, str):
        if plain_strings == "refuse":
            raise ChatMessageError(
                f"{where} ({role}) has its content as a plain string, which Gemma 4's processor rejects on transformers "
                f"5.5-5.6: write [{{'type': 'text', 'text': {content[:20]!r}}}] or pass plain_strings='keep'.")
        return [_text_part(content)] if plain_strings == "convert" and role not in INSTRUCTION_ROLES else content
    if not isinstance(content, (list, tuple)) or not content:
        raise ChatMessageError(f"{where} ({role}) needs content: a string or a non-empty list of parts such as "
                               f"{{'type': 'text', 'text': ...}}, not {content!r}.")
    parts = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ChatMessageError(f"{where} part {number} is a text part without a string under 'text': add 'text': '...'.")
        elif kind in MEDIA_KEYS:
            if role != "user":
                raise ChatMessageError(f"{where} part {number}: a {kind} can only come from the user, not from {role!r}.")
            if not any(key in part for key in MEDIA_KEYS[kind]):
                raise ChatMessageError(f"{where} part {number} is an {kind} part without its data: add one of "
                                       f"{', '.join(map(repr, MEDIA_KEYS[kind]))} (a PIL image, a path or a URL).")
        else:
            raise ChatMessageError(f"{where} part {number} must be a dict whose 'type' is 'text', 'image', 'audio' "
                                   f"or 'video', not {part!r}.")
        parts.append(dict(part))
    if role in INSTRUCTION_ROLES and plain_strings != "refuse":
        return " ".join(part["text"].strip() for part in parts)
    return parts


def _checked_tool_calls(calls, where: str):
    if calls is None:
        return None
    if not isinstance(calls, (list, tuple)) or not calls:
        raise ChatMessageError(f"{where} has tool_calls={calls!r}; write a non-empty list such as "
                               f"[{{'type': 'function', 'function': {{'name': 'get_weather', 'arguments': {{'city': 'Paris'}}}}}}].")
    checked = []
    for number, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatMessageError(f"{where} tool call {number} needs {{'function': {{'name': ..., 'arguments': {{...}}}}}}, "
                                   f"not {call!r}.")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            raise ChatMessageError(f"{where} tool call {number} has its arguments as a JSON string; Gemma 4's template "
                                   f"writes a dict (the July 2026 one refuses a string): pass json.loads(arguments).")
        if arguments is not None and not isinstance(arguments, dict):
            raise ChatMessageError(f"{where} tool call {number} has arguments {arguments!r}: write a dict of name -> value.")
        checked.append({**call, "function": {**function, "arguments": arguments}})
    return checked


def _checked_tool_message(message: dict, where: str, earlier: list) -> dict:
    """A tool response: Gemma 4's template writes it inside the model turn whose tool call it answers, so it
    must follow that assistant message (other tool responses between them are fine)."""
    previous = next((m for m in reversed(earlier) if m["role"] != "tool"), None)
    if previous is None or previous["role"] != "assistant" or not previous.get("tool_calls"):
        raise ChatMessageError(f"{where} is a tool response that follows no assistant message with tool_calls; "
                               f"the template would drop it: put it right after the model turn that called the tool.")
    content = message.get("content")
    if isinstance(content, dict):  # every published version fails on a mapping here (data/chat/published-templates.json)
        content = json.dumps(content, ensure_ascii=False, sort_keys=True)
    if isinstance(content, (list, tuple)) and content:
        content = _checked_content(content, where, "tool", "keep")
    elif not isinstance(content, (str, dict)):
        raise ChatMessageError(f"{where} (tool) needs content: the tool's result as a string or a dict, not {content!r}.")
    names = [call["function"]["name"] for call in previous["tool_calls"]]
    if "name" not in message and "tool_call_id" not in message and len(names) > 1:
        raise ChatMessageError(f"{where} (tool) answers one of {names}: add 'name' or 'tool_call_id' to say which.")
    return {**message, "content": content, **({} if "name" in message or "tool_call_id" in message else {"name": names[0]})}


def text_of(processor):
    """The tokenizer inside a processor (or the tokenizer itself)."""
    return getattr(require_tokenizer(processor, "processor"), "tokenizer", processor)


@dataclass
class Prompt:
    """What the model reads: the rendered text, its token ids, and the tensors ``generate`` takes."""

    text: str
    ids: list
    tokens: list
    inputs: dict = field(repr=False)

    def __len__(self):
        return len(self.ids)


def render(processor, messages, *, enable_thinking: bool = False, chat_template: str | None = None,
           add_generation_prompt: bool = True, plain_strings: str = "keep", tools=None) -> Prompt:
    """Render ``messages`` (and ``tools``, declared in the system turn) with the processor's chat template (or
    ``chat_template``) and tokenize it as ``generate`` will see it.

    The text is ``apply_chat_template(..., tokenize=False)`` of the messages as the template reads them
    (strings kept as strings); the ids are that text through the processor, as ``apply_chat_template(...,
    tokenize=True)`` does for a text-only chat. With an image, audio or video part the processor's own
    tokenizing route loads the media; on transformers 5.5-5.6, which cannot tokenize a string content, the
    strings are then sent as text parts."""
    messages = check_messages(messages, plain_strings=plain_strings)
    options = dict(add_generation_prompt=require_bool(add_generation_prompt, "add_generation_prompt"),
                   enable_thinking=require_bool(enable_thinking, "enable_thinking"), tools=_checked_tools(tools))
    if chat_template is not None:
        options["chat_template"] = chat_template
    if not _has_media(messages):
        text = processor.apply_chat_template(messages, tokenize=False, **options)
        inputs = dict(processor(text=text, add_special_tokens=False, return_tensors="pt"))
    else:
        if not PROCESSOR_TAKES_STRINGS:
            messages = check_messages(messages, plain_strings="convert")
        text = processor.apply_chat_template(messages, tokenize=False, **options)
        inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt", **options)
    ids = inputs["input_ids"][0].tolist()
    return Prompt(text=text, ids=ids, tokens=text_of(processor).convert_ids_to_tokens(ids), inputs=inputs)


def _has_media(messages) -> bool:
    return any(isinstance(m.get("content"), list) and any(p["type"] in MEDIA_KEYS for p in m["content"]) for m in messages)


def _checked_tools(tools):
    """``tools`` as ``apply_chat_template`` takes them: JSON-schema dicts, or Python functions with type hints and a
    docstring (transformers turns those into the schema)."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) or callable(t) for t in tools):
        raise ChatMessageError(f"tools must be a list of functions or {{'type': 'function', 'function': {{...}}}} dicts, "
                               f"not {tools!r}.")
    return list(tools)


def fingerprint(source: str) -> str:
    """The first 12 hex digits of a template text's sha256: two downloads with the same fingerprint render alike."""
    return hashlib.sha256(source.encode()).hexdigest()[:12]


class TextProcessor(ProcessorMixin):
    """transformers' processor machinery around the tokenizer alone.

    Gemma 4's processor needs torchvision for its video part; where torchvision is missing,
    this runs the same ``ProcessorMixin.apply_chat_template`` (Gemma4Processor does not override
    it) so that what the processor does with a message can be shown on any machine."""

    attributes = ["tokenizer"]
    tokenizer_class = "AutoTokenizer"

    def __init__(self, tokenizer, chat_template=None):
        super().__init__(tokenizer, chat_template=chat_template or tokenizer.chat_template)


def processor_route(processor):
    """``processor`` if it is a transformers processor, else ``TextProcessor`` around the tokenizer."""
    require_tokenizer(processor, "processor")
    return processor if isinstance(processor, ProcessorMixin) else TextProcessor(processor)


def plain_string_outcome(processor) -> str:
    """What ``apply_chat_template(tokenize=True)`` does with ``{"content": "Hello"}``: ``"accepted"``, or
    the exception's type and message (transformers 5.5-5.6's processors: ``TypeError: string indices
    must be integers, not 'str'``)."""
    require_tokenizer(processor, "processor")
    try:
        processor.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)
    except Exception as err:  # the outcome is the point: report any library error as it is
        return f"{type(err).__name__}: {err}"
    return "accepted"


def template_source(processor, chat_template: str | None = None) -> str:
    source = chat_template if chat_template is not None else getattr(processor, "chat_template", None)
    if not source:
        raise ChatTemplateError("This processor carries no chat template: pass chat_template=... (the text of a .jinja file).")
    return source


def describe_template(processor, chat_template: str | None = None) -> dict:
    """How a chat template behaves, found by rendering probes (so it works on any checkpoint's template and tells
    the published versions apart): the generation prompt, the thinking switch, whether an earlier thought is
    replayed, how a system prompt written as a list of parts comes out (April 2026's writes Python text, May's
    and July's add a space), whether the developer role and a later system message are rendered, whether tools
    are declared, and the generation prompt after a tool response with thinking off and on. A probe the
    template cannot render reads ``None``."""
    source = template_source(processor, chat_template)

    def rendered(messages, **options):
        try:
            return processor.apply_chat_template(messages, tokenize=False, chat_template=source, **options)
        except Exception:  # a template that cannot render this probe (an older format): the answer is None
            return None

    def after(longer, shorter):
        return longer[len(shorter):] if longer is not None and shorter is not None and longer.startswith(shorter) else None

    question = [{"role": "user", "content": "PROBE"}]
    closed = rendered(question, add_generation_prompt=False)
    opened = rendered(question, add_generation_prompt=True)
    thinking = rendered(question, add_generation_prompt=True, enable_thinking=True)
    history = rendered([*question, {"role": "assistant", "content": f"{THOUGHT_OPEN}thought\nSECRET{THOUGHT_CLOSE}SAID"},
                        *question], add_generation_prompt=True)
    parts = rendered([{"role": "system", "content": [_text_part("BRIEF")]}, *question])
    developer = rendered([{"role": "developer", "content": "BRIEF"}, *question])
    later = rendered([*question, {"role": "assistant", "content": "SAID"}, {"role": "system", "content": "LATER"}, *question])
    tool = {"type": "function", "function": {"name": "probe_tool", "description": "PROBE",
                                              "parameters": {"type": "object", "properties": {}}}}
    called = [*question, {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "probe_tool", "arguments": {}}}]}]
    answered = [*called, {"role": "tool", "name": "probe_tool", "content": "RESULT"}]
    declared = rendered(question, tools=[tool])
    return {
        "sha256": fingerprint(source),
        "characters": len(source),
        "generation prompt": after(opened, closed),
        "enable_thinking changes the prompt": thinking != opened,
        "thinking switch": THINK_SWITCH if thinking and opened and THINK_SWITCH in thinking and THINK_SWITCH not in opened else None,
        "earlier thoughts replayed": None if history is None else "SECRET" in history,
        "system prompt as parts": _between(parts, "system\n", "<turn|>"),
        "developer role as the system turn": None if developer is None else "system\nBRIEF<turn|>" in developer,
        "later system message rendered": None if later is None else "LATER" in later,
        "tools declared": None if declared is None else TOOL_DECLARATION_OPEN in declared,
        "generation prompt after a tool response": after(rendered(answered, tools=[tool], add_generation_prompt=True),
                                                         rendered(answered, tools=[tool])),
        "same, thinking on": after(rendered(answered, tools=[tool], add_generation_prompt=True, enable_thinking=True),
                                   rendered(answered, tools=[tool], enable_thinking=True)),
    }


def _between(text, start: str, end: str):
    if text is None or start not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0]


def split_thought(text: str) -> tuple[str, str]:
    """(thought, answer) from a reply written as ``<|channel>thought\\n...<channel|>answer``; a reply
    stopped mid-thought has an empty answer."""
    if THOUGHT_OPEN not in text:
        return "", text.strip()
    before, _, rest = text.partition(THOUGHT_OPEN)
    thought, closed, after = rest.partition(THOUGHT_CLOSE)
    thought = thought.removeprefix("thought").strip()
    return thought, (before + after).strip() if closed else before.strip()


# How a Gemma 4 reply is parsed into {"thinking", "content", "tool_calls"}, written by the course in the two
# formats transformers' own parser reads: a response_template (transformers 5.17 and later:
# ``tokenizer.parse_response(text, schema, prefix=prompt)``) and a response_schema with regexes and the
# "gemma4-tool-call" parser (transformers 5.5-5.16: ``tokenizer.parse_response(text, schema)``).
RESPONSE_TEMPLATE = {
    "version": 1,
    "start_anchor": "<|turn>model\n",
    "fields": {
        "thinking": {"open": "<|channel>thought\n", "close": "<channel|>", "content": "text"},
        "tool_calls": {"open_pattern": r"<\|tool_call>call:(?P<name>[\w.-]+)", "close": "<tool_call|>", "content": "json",
                       "content_args": {"unquoted_keys": True, "string_delims": [[QUOTE, QUOTE]]}, "repeats": True,
                       "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}},
        "content": {"content": "text"},
    },
}
RESPONSE_SCHEMA = {
    "type": "object",
    "properties": {
        "thinking": {"type": "string", "x-regex": r"<\|channel>thought\n(.*?)<channel\|>"},
        "content": {"type": "string", "x-regex": r"^(?:<\|channel>.*?<channel\|>)?((?:(?!<\|tool_call>).)+?)\s*(?:<\|tool_call>|$)"},
        "tool_calls": {"type": "array", "x-regex-iterator": r"<\|tool_call>(call:.*?)<tool_call\|>",
                       "items": {"type": "object", "x-regex": r"call:(?P<name>[\w.-]+)(?P<arguments>\{.*\})",
                                 "properties": {"name": {"type": "string"},
                                                "arguments": {"type": "object", "x-parser": "gemma4-tool-call"}}}},
    },
}
CALL_PATTERN = re.compile(r"<\|tool_call>call:([\w.-]+)(\{.*?\})<tool_call\|>", re.DOTALL)


def parse_reply(tokenizer, text: str, prompt: str = "") -> dict:
    """A model's reply as a message: ``{"role": "assistant", "content", "thinking"?, "tool_calls"?}``, each tool call
    as ``{"type": "function", "function": {"name", "arguments": {...}}}``, ready to go back into the history.
    Parsed by transformers' ``parse_response`` in the format this release reads (the key ``"parsed by"`` says
    which), or by the course's regex where the tokenizer has no ``parse_response``."""
    tokenizer = text_of(tokenizer)
    parse = getattr(tokenizer, "parse_response", None)
    if parse is not None and "prefix" in inspect.signature(parse).parameters:
        parsed, route = parse(text, RESPONSE_TEMPLATE, prefix=prompt), "transformers parse_response (response_template)"
    elif parse is not None:
        parsed, route = parse(text, RESPONSE_SCHEMA), "transformers parse_response (response_schema)"
    else:
        parsed, route = _parse_by_regex(text), "the course's regex (this transformers has no parse_response)"
    message = {"role": "assistant", "content": (parsed.get("content") or "").strip()}
    if parsed.get("thinking"):
        message["thinking"] = parsed["thinking"].strip()
    calls = [{"type": "function", "function": {"name": c["function"]["name"] if "function" in c else c["name"],
                                               "arguments": (c["function"] if "function" in c else c)["arguments"]}}
             for c in parsed.get("tool_calls") or []]
    if calls:
        message["tool_calls"] = calls
    return {**message, "parsed by": route}


def _parse_by_regex(text: str) -> dict:
    thought, answer = split_thought(text)
    calls = [{"name": name, "arguments": json.loads(_gemma_arguments_as_json(body))} for name, body in CALL_PATTERN.findall(answer)]
    return {"thinking": thought, "content": CALL_PATTERN.sub("", answer).split(TOOL_RESPONSE_OPEN)[0], "tool_calls": calls}


def _gemma_arguments_as_json(body: str) -> str:
    """Gemma 4's ``{city:<|"|>Paris<|"|>,days:2}`` as JSON: quoted strings set aside, bare keys quoted."""
    strings = []
    body = re.sub(re.escape(QUOTE) + "(.*?)" + re.escape(QUOTE), lambda m: strings.append(m.group(1)) or f"\x00{len(strings) - 1}\x00",
                  body, flags=re.DOTALL)
    body = re.sub(r"(?<=[{,])\s*([\w.-]+)\s*:", r'"\1":', body)
    return re.sub("\x00(\\d+)\x00", lambda m: json.dumps(strings[int(m.group(1))]), body)


def example_forecast(city: str, days: int = 1) -> dict:
    """A made-up weather forecast: the tool notebook 07 declares, and runs when a model turn calls it.

    Args:
        city: The city to forecast, e.g. "Paris".
        days: How many days ahead, from 1 to 7.
    """
    if not isinstance(city, str) or not city.strip():
        raise InvalidChoiceError(f"city={city!r} is not a city name; pass one as text, e.g. city='Paris'.")
    require_whole_number(days, "days", minimum=1)
    if days > 7:
        raise InvalidChoiceError(f"days={days} is more than this forecast covers; pass 1 to 7.")
    return {"city": city, "days": days, "sky": "sunny (made up by the course)"}


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked. Greedy takes the most likely token: reproducible, the choice for
    tests and comparisons, and prone to loops in long chats. Sampling draws from the distribution:
    ``temperature`` flattens (>1) or sharpens (<1) it, ``top_k`` keeps the k likeliest tokens, ``top_p``
    the smallest set whose probabilities add up to p. ``None`` leaves transformers' value."""

    do_sample: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    def __post_init__(self):
        require_bool(self.do_sample, "do_sample")
        if self.seed is not None:
            require_whole_number(self.seed, "seed", minimum=0)
        if isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool) and self.temperature <= 0:
            raise InvalidChoiceError(f"temperature={self.temperature} must be above 0: use Sampling.greedy() for the likeliest token.")
        if self.temperature is not None:
            require_positive_number(self.temperature, "temperature")  # not True, not inf
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InvalidChoiceError(f"top_p={self.top_p} must be in (0, 1]: 1 keeps every token, 0.9 the likeliest 90%.")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise InvalidChoiceError(f"top_k={self.top_k!r} must be a whole number of at least 1.")

    @classmethod
    def greedy(cls) -> Sampling:
        return cls(do_sample=False)

    @classmethod
    def from_checkpoint(cls, model, seed: int | None = None) -> Sampling:
        """Sampling with the values the checkpoint's ``generation_config.json`` sets (None where it sets none)."""
        config = model.generation_config
        return cls(do_sample=True, temperature=config.temperature, top_p=config.top_p, top_k=config.top_k, seed=seed)

    def generate_kwargs(self) -> dict:
        if not self.do_sample:
            return {"do_sample": False}
        chosen = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return {"do_sample": True, **{key: value for key, value in chosen.items() if value is not None}}


class StopSignal(StoppingCriteria):
    """A stopping criterion a button (or any thread) sets: ``generate`` checks it after every token."""

    def __init__(self):
        self.event = threading.Event()

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def stop_token_ids(model_or_generation_config) -> list:
    """The ids ``generate`` ends a reply on: ``generation_config.eos_token_id`` (for Gemma 4, ``<eos>``, ``<turn|>``
    and ``<|tool_response>``)."""
    ids = getattr(model_or_generation_config, "generation_config", model_or_generation_config).eos_token_id
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]


def free_gpu_cache() -> int:
    """Hand the memory PyTorch's caching allocator keeps reserved back to the GPU; the bytes still
    reserved afterwards (0 without CUDA)."""
    gc.collect()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


@dataclass
class Reply:
    """One finished turn: the new tokens only, decoded, split into thought and answer, and why it stopped."""

    prompt: Prompt = field(repr=False)
    new_ids: list
    text: str
    thought: str
    answer: str
    stopped_by: str
    streamed: list = field(repr=False)
    seconds: float
    reserved_bytes_after: int

    @property
    def tokens_per_second(self) -> float:
        return len(self.new_ids) / self.seconds if self.seconds else 0.0


class Turn:
    """A reply being generated in the background, shown in a widget with a stop button.

    The cell that starts it returns at once, so the notebook can take the button's click while the
    model writes; ``wait()`` blocks until the reply is complete and returns it."""

    def __init__(self, chat: Chat, messages: list, prompt: Prompt, max_new_tokens: int):
        import ipywidgets as widgets

        self.chat, self.messages, self.prompt = chat, messages, prompt
        self.max_new_tokens = _check_new_tokens(max_new_tokens)
        self.signal = StopSignal()
        self.stop_button = widgets.Button(description="Stop", icon="stop", button_style="warning")
        self.stop_button.on_click(lambda _, stop=self.signal.event: stop.set())  # holds no Turn: see _run
        self.text_area = widgets.HTML()
        self.status = widgets.Label("writing")
        self.widget = widgets.VBox([widgets.HBox([self.stop_button, self.status]), self.text_area])
        self._reply: Reply | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._worker = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Turn:
        self._worker.start()
        return self

    def stop(self) -> None:
        """What the button does: ``generate`` ends after the token it is computing."""
        self.signal.event.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Reply:
        """The reply, once written; ``timeout`` seconds at most (None: as long as it takes)."""
        if timeout is not None:
            timeout = require_number(timeout, "timeout")
        if not self._done.wait(timeout):
            raise ReplyInProgressError(f"The reply is still being written after {timeout} s: press Stop, or wait longer.")
        if self._error is not None:
            raise self._error
        return self._reply

    def __repr__(self):
        return f"<Turn: {'done' if self.done else 'writing'}; the widget shows the reply, wait() returns it>"

    def _show(self, text: str, status: str) -> None:
        thought, answer = split_thought(text)
        shown = (f"<i style='color:gray'>thought: {html.escape(thought)}</i><br>" if thought else "") + html.escape(
            answer if thought else text)
        self.text_area.value = f"<pre style='white-space:pre-wrap;margin:0'>{shown}</pre>"
        self.status.value = status

    def _run(self) -> None:
        try:
            self._reply = self.chat._generate(self)
            self._show(self._reply.text, f"stopped by {self._reply.stopped_by} after {len(self._reply.new_ids)} tokens "
                                         f"in {self._reply.seconds:.1f} s")
        except BaseException as err:  # shown in the widget and raised again by wait()
            self._error = err
            self.status.value = f"failed: {type(err).__name__}: {err}"
        finally:
            self.stop_button.disabled = True
            self.chat = None  # a finished turn, kept in a variable or a widget, does not keep the model loaded
            self._done.set()


class Chat:
    """A conversation with one model: the history, the template options and the sampling settings.

    ``ask(text)`` checks the message, renders the whole history with the checkpoint's chat template,
    streams the reply into a widget, appends both turns to ``history`` and frees the GPU's cached
    memory; ``prompt(text)`` shows what the model would read."""

    def __init__(self, model, processor, *, system: str | None = None, sampling: Sampling | None = None,
                 max_new_tokens: int = 128, enable_thinking: bool = False, plain_strings: str = "keep",
                 chat_template: str | None = None, history=None, tools=None):
        self.model, self.processor, self.tokenizer = model, processor, text_of(processor)
        self.sampling = sampling if sampling is not None else Sampling.from_checkpoint(model)
        self.max_new_tokens = _check_new_tokens(max_new_tokens)
        self.enable_thinking = require_bool(enable_thinking, "enable_thinking")
        self.plain_strings, self.chat_template, self.tools = plain_strings, chat_template, _checked_tools(tools)
        start = [{"role": "system", "content": system}] if system else []
        self.history = check_messages([*start, *(history or [])], plain_strings=plain_strings) if (start or history) else []
        self._current: Turn | None = None

    def _with(self, content) -> list:
        if self._current is not None and not self._current.done:
            raise ReplyInProgressError("The previous reply is still being written: press its Stop button or call turn.wait() first.")
        message = {"role": "user", "content": content}
        return check_messages([*self.history, message], plain_strings=self.plain_strings)

    def box(self):
        """A chat box for the learner's own messages: type one and press Enter (or Send); each reply streams in
        below it with its own Stop button, and the history grows as with ``ask``. Returns the widget."""
        import ipywidgets as widgets

        chat = weakref.ref(self)  # the widgets outlive `del session, model` in ipywidgets' registry; they must not keep it
        transcript = widgets.VBox()
        text = widgets.Text(placeholder="Ask the model, then press Enter", continuous_update=False,
                            layout=widgets.Layout(width="70%"))
        send = widgets.Button(description="Send", icon="paper-plane", button_style="primary")
        status = widgets.Label("")

        def submit(_=None):
            message = text.value.strip()
            if not message:
                return
            session = chat()
            if session is None:
                status.value = "This chat has ended: its model was deleted. Start a new Chat to go on."
                return
            try:
                turn = session.ask(message, display=False)
            except CourseError as error:  # a reply still being written, a message the template cannot take
                status.value = str(error)
                return
            status.value, text.value = "", ""
            transcript.children = (*transcript.children, widgets.HTML(f"<b>you:</b> {html.escape(message)}"), turn.widget)

        send.on_click(submit)
        text.observe(submit, names="value")  # Enter (or leaving the box) commits the value
        box = widgets.VBox([transcript, widgets.HBox([text, send]), status])
        box.text, box.send, box.transcript = text, send, transcript  # for tests and a curious learner
        return box

    def prompt(self, content) -> Prompt:
        """The prompt the model would read if ``content`` were sent now (nothing is generated)."""
        return render(self.processor, self._with(content), enable_thinking=self.enable_thinking,
                      chat_template=self.chat_template, plain_strings=self.plain_strings, tools=self.tools)

    def ask(self, content, *, max_new_tokens: int | None = None, display: bool = True) -> Turn:
        """Send ``content`` (a string or a list of parts) and stream the reply; returns the running ``Turn``."""
        require_bool(display, "display")
        messages = self._with(content)
        if not isinstance(self.processor, ProcessorMixin) and _has_media(messages[-1:]):
            raise ChatMessageError("Images, audio and video need Gemma 4's full processor, which needs torchvision: "
                              "pip install torchvision (matching your torch), then load the processor again.")
        prompt = render(self.processor, messages, enable_thinking=self.enable_thinking,
                        chat_template=self.chat_template, plain_strings=self.plain_strings, tools=self.tools)
        turn = Turn(self, messages, prompt, _check_new_tokens(self.max_new_tokens if max_new_tokens is None else max_new_tokens))
        self._current = turn
        if display:
            from IPython.display import display as show

            show(turn.widget)
        return turn.start()

    def _generate(self, turn: Turn) -> Reply:
        prompt = turn.prompt
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=False)
        inputs = _on_device(prompt.inputs, self.model)
        if self.sampling.seed is not None:
            torch.manual_seed(self.sampling.seed)
        result = {}

        def generate():
            try:
                with torch.no_grad():
                    result["ids"] = self.model.generate(
                        **inputs, max_new_tokens=turn.max_new_tokens, streamer=streamer,
                        stopping_criteria=StoppingCriteriaList([turn.signal]), **self.sampling.generate_kwargs())
            except BaseException as err:
                result["error"] = err
                streamer.end()  # let the loop below finish instead of waiting for tokens forever

        started = time.perf_counter()
        worker = threading.Thread(target=generate, daemon=True)
        worker.start()
        streamed = []
        for chunk in streamer:
            streamed.append(chunk)
            turn._show("".join(streamed), f"streaming: {len(streamed)} pieces")
        worker.join()
        seconds = time.perf_counter() - started
        if isinstance(result.get("error"), torch.OutOfMemoryError):
            free_gpu_cache()
            raise InsufficientGPUMemoryError(
                f"The GPU ran out of memory on a {len(prompt.ids):,}-token prompt plus up to {turn.max_new_tokens} new tokens: "
                f"start a new Chat (the history is the prompt), lower max_new_tokens, or load with quant='nf4', ple='cpu'.") from None
        if "error" in result:
            raise result["error"]
        new_ids = result.pop("ids")[0, len(prompt.ids):].tolist()
        stops = stop_token_ids(self.model)
        stopped_by = ("stop token" if new_ids and new_ids[-1] in stops else
                      "stop button" if turn.signal.event.is_set() else "max_new_tokens")
        kept = new_ids[:-1] if stopped_by == "stop token" else new_ids
        text = self.tokenizer.decode(kept, skip_special_tokens=False)
        thought, answer = split_thought(text)
        self.history = [*turn.messages, {"role": "assistant", "content": text}]
        return Reply(prompt=prompt, new_ids=new_ids, text=text, thought=thought, answer=answer, stopped_by=stopped_by,
                     streamed=streamed, seconds=seconds, reserved_bytes_after=free_gpu_cache())


def _on_device(inputs, model) -> dict:
    """The prompt's tensors beside the model's input embedding; pixel and audio features in the model's dtype."""
    device = compute_device_of(model)  # with ple="cpu" the PLE table is on the CPU, the decoder on the GPU
    return {key: value.to(device, dtype=model.dtype) if value.is_floating_point() else value.to(device)
            for key, value in inputs.items()}


def _check_new_tokens(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidChoiceError(f"max_new_tokens={value!r} must be a whole number of at least 1.")
    return value


def probe(source=None) -> dict:
    """What this environment's transformers does with a plain-string message, through the full Gemma 4
    processor where torchvision allows it, else through ``TextProcessor`` (the same inherited code)."""
    processor = loading.load_processor(source)
    routed = processor_route(processor)
    rendered = {}
    for tokenize in (False, True):
        try:
            routed.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                       tokenize=tokenize, return_dict=tokenize)
            rendered[f"tokenize={tokenize}"] = "accepted"
        except Exception as err:  # recorded as it is: the message is the finding
            rendered[f"tokenize={tokenize}"] = f"{type(err).__name__}: {err}"
    return {"transformers": transformers.__version__, "processor": type(routed).__name__, **rendered,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}


def main(argv=None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(description="Chat-template checks from the command line.")
    parser.add_argument("command", choices=["probe"], help="probe: what apply_chat_template does with a plain-string message")
    parser.add_argument("--model", default=None, help="checkpoint (default $GEMMA_MODEL or tiny)")
    args = parser.parse_args(argv)
    try:
        print(json.dumps(probe(args.model)))
    except CourseError as err:  # a model that is not there: its sentence, not a traceback
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
