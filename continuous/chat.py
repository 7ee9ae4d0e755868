"""Conversations through a model's own chat template, forwarding only the new tokens.

Three levels, from the simplest:

- :func:`prompt` renders a list of ``{"role", "content"}`` messages with the generation
  prompt: the text to give a generator for the first answer.
- :func:`turn` is the text one more message adds after a state that ends with an
  assistant's answer (``state + chat.turn(model, "user", "...")``), for templates that
  render each message on its own (most do). It is found by rendering a probe
  conversation, so it needs no history.
- :func:`sync` and :class:`Conversation` keep the messages and make the state's text
  equal the template rendered on all of them, always: the state is extended where the
  new rendering extends its text, and rewound to the first changed character (its
  cache kept up to there) where the template rewrites an earlier turn, with a
  :class:`TemplateRewriteWarning`.

A message's content is text: the text of a special token in it is encoded as text, never
as that token, while the template's own markers stay special (see :func:`prompt`;
``special_in_content=True`` turns this off). Calls sent back in an assistant message's
``tool_calls`` are written as the model writes them where the template does not render them.

Examples
--------
>>> from continuous import continuous, generate, chat                 # doctest: +SKIP
>>> conv = chat.Conversation(model, [{"role": "user", "content": "Hi"}])  # doctest: +SKIP
>>> conv.reply(continuous(generate.text(model)), max_tokens=32)      # doctest: +SKIP
>>> conv.add("user", "And then?"); conv.reply(gen, max_tokens=32)    # doctest: +SKIP
"""

from __future__ import annotations

import functools
import json
import re
import uuid
import warnings

from .layout import Text

__all__ = ["prompt", "turn", "sync", "Conversation", "TemplateRewriteWarning"]

# Text no template produces: it marks where a probe assistant message's content is.
_PROBE = "\x00continuous-probe\x00"


class TemplateRewriteWarning(UserWarning):
    """The chat template changed text it had already rendered; the state was rewound."""


def _tokenizer(model):
    tok = getattr(model, "tokenizer", model)
    if getattr(tok, "chat_template", None) is None:
        raise ValueError("this tokenizer has no chat template; set tokenizer.chat_template (a Jinja string)")
    return tok


def prompt(model, messages: list[dict], *, add_generation_prompt: bool = True, special_in_content: bool = False,
           **template_kwargs) -> str:
    """The text of ``messages`` in the model's chat template.

    A message's content is text: where it holds a special token's text (``<|im_end|>``),
    the result is a :class:`~continuous.layout.Text` that encodes it as text, so that no
    message can write the template's own markers. The template's markers stay special.

    An assistant message's ``tool_calls`` (OpenAI's form, as agent loops send them back)
    that the template does not render are written into its content in the form the
    model writes its calls (see :func:`continuous.generate.tools`), so that the next
    turn continues what the model wrote.

    Parameters
    ----------
    model
        A continuous model (its ``tokenizer`` is used) or a HF tokenizer.
    messages
        ``{"role": ..., "content": ...}`` dicts.
    add_generation_prompt
        End with the opening of an assistant message (what a generator continues).
    special_in_content
        Encode special tokens' text in contents as those tokens, as a ``str`` is encoded:
        for contents that are meant to hold control tokens.
    **template_kwargs
        Passed to ``apply_chat_template`` (``tools=``, ``documents=``, template variables).

    Raises
    ------
    ValueError
        When the tokenizer has no chat template.
    """
    tok = _tokenizer(model)
    guard = _Guard(tok, off=special_in_content)
    form = _call_form(tok) if any(m.get("tool_calls") for m in messages) else None
    messages = [_message(m, guard, form) for m in messages]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                   **template_kwargs)
    return guard.restore(text)


class _Guard:
    """Special tokens' text in contents, swapped for marks that no template changes while the
    template renders, then restored as plain spans of a :class:`~continuous.layout.Text`."""

    def __init__(self, tokenizer, off: bool = False):
        found = frozenset(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                          if t.special and t.content)
        self.pattern = _pattern(found) if found and not off else None
        # Private-use characters: JSON filters (tojson) and trim leave them as they are.
        self.mark = f"\ue000{uuid.uuid4().hex[:8]}"
        self.swapped: list[str] = []

    def __call__(self, content):
        """``content`` (text, or a list of parts) with its special tokens' text swapped."""
        if self.pattern is None:
            return content
        if isinstance(content, str):
            return self.pattern.sub(self._swap, content)
        if isinstance(content, list):
            return [dict(part, text=self(part["text"])) if isinstance(part, dict) and isinstance(part.get("text"), str)
                    else part for part in content]
        return content

    def _swap(self, match) -> str:
        self.swapped.append(match.group())
        return f"{self.mark}{len(self.swapped) - 1}\ue001"

    def restore(self, text: str) -> str:
        if not self.swapped:
            return text
        parts, plain, at, length = [], [], 0, 0
        for match in re.finditer(re.escape(self.mark) + "([0-9]+)\ue001", text):
            original = self.swapped[int(match.group(1))]
            parts += [text[at:match.start()], original]
            length += match.start() - at
            plain.append((length, length + len(original)))
            length += len(original)
            at = match.end()
        text = "".join(parts) + text[at:]
        return Text(text, plain) if plain else text


@functools.lru_cache(maxsize=16)
def _pattern(specials: frozenset) -> re.Pattern:
    return re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))


def _message(message: dict, guard: _Guard, form) -> dict:
    """The message as the template gets it: its content guarded, and its calls written into it
    in ``form`` (where the template does not render them)."""
    out = dict(message)
    if "content" in out:
        out["content"] = guard(out["content"])
    calls = out.get("tool_calls")
    if calls and form is not None:
        del out["tool_calls"]
        out["content"] = (out.get("content") or "") + _calls_text(calls, form, guard)
    return out


def _calls_text(calls: list[dict], form, guard: _Guard) -> str:
    """The calls as the model writes them in ``form`` (JSON laid out as ``json.dumps`` does)."""
    written = []
    for call in calls:
        function = call.get("function", call)
        arguments = function.get("arguments")
        if isinstance(arguments, str):  # OpenAI's form: a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # written as it came
        body = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        written.append(guard(f'{{"name": {json.dumps(function.get("name"), ensure_ascii=False)}, '
                             f'"{form.arguments}": {body}}}'))
    if form.name == "mistral":
        return form.open + "[" + ", ".join(written) + "]"
    if form.name == "llama3":
        return "\n".join(written)
    return "".join(form.open + w + form.close for w in written)


def _call_form(tokenizer):
    """The form to write an assistant message's ``tool_calls`` in, or ``None`` where the chat
    template renders them itself (seen on a probe message)."""
    from .engines.tools import HERMES

    name = "continuous_probe_call"
    probe = [{"role": "user", "content": "?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": "call_probe", "type": "function", "function": {"name": name, "arguments": {}}}]}]
    try:
        if name in tokenizer.apply_chat_template(probe, tokenize=False):
            return None
    except Exception:  # a template that refuses them does not render them
        pass
    return _template_form(tokenizer) or HERMES


def _template_form(tokenizer):
    """The form of calls the chat template asks for, where it renders tools (else ``None``):
    a :class:`~continuous.engines.tools.CallFormat`, told by what its text holds."""
    from .engines.tools import HERMES, LLAMA3, MISTRAL  # the constraints' module: loaded when tools are used

    template = getattr(tokenizer, "chat_template", None)
    forms = (("<tool_call>", HERMES), ("[TOOL_CALLS]", MISTRAL), ('"parameters"', LLAMA3))  # in the order tried
    form = next((f for mark, f in forms if mark in template), None) if isinstance(template, str) else None
    if form is None:
        return None
    probe = [{"role": "user", "content": "?"}]
    spec = {"type": "function", "function": {"name": "probe_tool", "description": "",
                                             "parameters": {"type": "object", "properties": {}}}}
    try:
        rendered = prompt(tokenizer, probe, tools=[spec])
    except Exception:  # a template that cannot take tools=
        return None
    return form if "probe_tool" in rendered else None


def turn(model, role: str, content: str, *, add_generation_prompt: bool = True, **template_kwargs) -> str:
    """The text one message adds after a state that ends with an assistant's answer.

    That is the end of the assistant's message (the template's end-of-turn marker), the
    new message, and the generation prompt. ``state + chat.turn(model, "user", text)``
    then forwards only these tokens at the next call.

    The text is read off a probe conversation (a user message, an assistant message,
    then this one), so it is right for templates that render each message on its own,
    whatever came before. Templates that depend on the whole history (a system prompt
    that changes, numbered turns) need :func:`sync` or :class:`Conversation`, which
    compare with the full rendering.

    ``content`` is text, as in :func:`prompt` (``special_in_content=True`` to pass control
    tokens, with the other ``template_kwargs``).

    Raises
    ------
    ValueError
        When the template does not render an assistant message's content as it is
        (then only :func:`sync` can say what to add).
    """
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}]
    text = prompt(model, probe + [{"role": role, "content": content}],
                  add_generation_prompt=add_generation_prompt, **template_kwargs)
    at = text.rfind(_PROBE)
    if at < 0:
        raise ValueError("the chat template does not show an assistant message's content verbatim; use chat.sync")
    return text[at + len(_PROBE):]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def sync(state, text: str):
    """``state`` changed as little as possible so that its text is ``text``.

    Where ``text`` extends the state's text, the rest is appended (only its tokens are
    forwarded next). Otherwise the state is cut at the first differing character,
    keeping the cache of that prefix, and the rest appended, with a
    :class:`TemplateRewriteWarning`.

    Parameters
    ----------
    state
        A one-row :class:`~continuous.state.SequenceState`.
    text
        The text it must hold.
    """
    if state.batch_size * state.num_samples != 1:
        raise ValueError("a conversation state has one row; select one with state[b, s, :]")
    old = str(state)
    k = _common_prefix(old, text)
    if k < len(old):
        warnings.warn(
            f"the chat template rewrote earlier text (first change at character {k} of {len(old)}: "
            f"{old[k:k + 20]!r} became {text[k:k + 20]!r}); the state is rewound there and the rest recomputed",
            TemplateRewriteWarning, stacklevel=2)
        state = state[:k]
    return state + text[k:] if k < len(text) else state


class Conversation:
    """A chat: its messages, and a state whose text is always the template rendered on them.

    Parameters
    ----------
    model
        A continuous model with a chat template.
    messages
        The first messages (a system prompt, a user question...).
    **template_kwargs
        Passed to every rendering (``tools=`` and the like, and :func:`prompt`'s
        ``special_in_content``).

    Attributes
    ----------
    messages : list[dict]
        Every message so far, the generated answers included.
    state : SequenceState or None
        The conversation's state after the last :meth:`reply` (``None`` before the first).

    Notes
    -----
    :meth:`reply` renders all messages with the generation prompt and brings the state
    to that text with :func:`sync`: on a prefix-stable template only the new messages'
    tokens are forwarded; a template that rewrites earlier turns costs the tokens
    after the first change, and warns.
    """

    def __init__(self, model, messages: list[dict] = (), **template_kwargs):
        _tokenizer(model)
        self.model = model
        self.messages = [dict(m) for m in messages]
        self.template_kwargs = template_kwargs
        self.state = None

    def add(self, role: str, content: str | None, **fields) -> "Conversation":
        """Append a message (forwarded at the next :meth:`reply`); returns ``self``.

        ``fields`` are the message's other keys, as the template reads them: an agent
        loop's ``conv.add("assistant", None, tool_calls=[...])`` then ``conv.add("tool",
        "18", tool_call_id=...)`` (calls are written as :func:`prompt` says).
        """
        self.messages.append({"role": role, "content": content, **fields})
        return self

    def text(self) -> str:
        """The template rendered on all messages, with the generation prompt."""
        return prompt(self.model, self.messages, **self.template_kwargs)

    def reply(self, generator, **call_kwargs) -> str:
        """Generate the assistant's answer to the messages so far, record it, and return it.

        Parameters
        ----------
        generator
            A :class:`~continuous.wrapper.ContinuousGenerator` on this conversation's model.
        **call_kwargs
            ``max_tokens``, ``stop_at``, ``seed``... as for the generator's call.
        """
        target = self.text()
        start = target if self.state is None else sync(self.state, target)
        state = generator(start, **call_kwargs)
        if state.batch_size * state.num_samples != 1:
            raise ValueError("a conversation has one row: reply with a generator of one sample")
        full = str(state)
        if not full.startswith(target):  # the generator keeps its input's text; anything else is a bug
            raise RuntimeError("the generated state does not start with the conversation's text")
        # The message is what was generated, without a stop string; the state is cut there too
        # (its cache kept), so that the next rendering extends it.
        answer = full[len(target):]
        value = state._values[0] if state._values is not None and state._values[0] is not None else answer
        answer = answer[: len(value)] if answer.startswith(value) else answer
        eos = getattr(_tokenizer(self.model), "eos_token", None)
        if eos and answer.endswith(eos):
            # A decoder that keeps the EOS token's text: the message's content is what the
            # template wraps in its own end-of-turn marker.
            answer = answer[: -len(eos)]
        if len(target) + len(answer) < len(full):
            state = state[: len(target) + len(answer)]
        # Only a reply that went through changes the conversation: a failed one leaves it as it was.
        self.state = state
        self.messages.append({"role": "assistant", "content": answer})
        return answer

    def __repr__(self) -> str:
        return f"Conversation({len(self.messages)} messages, state={'none' if self.state is None else 'kept'})"
