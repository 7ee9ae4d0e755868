from .. import engines
from .base import SequenceGenerator, make
from .types import grammar_of


def cfg(model, grammar: str, sampler=None, *, ban=None, ban_case=False, think=None) -> SequenceGenerator:
    """Text in the language of a context-free grammar; ``value`` is the text.

    Parameters
    ----------
    grammar
        A Lark grammar in llguidance's dialect (the start rule is ``start``; terminals
        may be regular expressions, ``%json {...}`` embeds a JSON schema), or an
        ``outlines.types.CFG``.
    ban, ban_case, think
        As for every generator (:func:`~continuous.generate.text`).

    Raises
    ------
    ValueError
        When llguidance refuses the grammar, with its reason.
    """
    grammar = grammar_of(grammar) or grammar
    if not isinstance(grammar, str):
        raise TypeError(f"grammar must be a str (Lark syntax) or an outlines.types.CFG, got {type(grammar).__name__}")
    return make(model, sampler, lambda tokenizer: engines.grammar(grammar, tokenizer), kind="cfg", ban=ban,
                ban_case=ban_case, think=think)
