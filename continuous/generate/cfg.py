from .. import engines
from .base import SequenceGenerator, check_model, make


def cfg(model, grammar: str, sampler=None, *, ban=None, ban_case=False) -> SequenceGenerator:
    """Text in the language of a context-free grammar; ``value`` is the text.

    Parameters
    ----------
    grammar
        A Lark grammar in llguidance's dialect (the start rule is ``start``; terminals
        may be regular expressions, ``%json {...}`` embeds a JSON schema).
    ban, ban_case
        Phrases and ``regex`` patterns the output may not contain (:mod:`continuous.ban`).

    Raises
    ------
    ValueError
        When llguidance refuses the grammar, with its reason.
    """
    if not isinstance(grammar, str):
        raise TypeError(f"grammar must be a str (Lark syntax), got {type(grammar).__name__}")
    check_model(model)
    return make(model, sampler, engines.grammar(grammar, model.tokenizer), kind="cfg", ban=ban, ban_case=ban_case)
