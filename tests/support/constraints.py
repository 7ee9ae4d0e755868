"""Reading a generator's language in tests."""

import torch


def accepts(gen, text: str) -> bool:
    """Whether the generator's constraint takes ``text`` whole (fed as the tokenizer splits it)."""
    tok = gen.model.tokenizer
    matcher = gen.constraint.matcher()
    mask = torch.zeros((gen.model.vocab_size + 31) // 32, dtype=torch.int32)
    for t in tok(text, add_special_tokens=False).input_ids:
        matcher.fill(mask)
        if not (int(mask[t // 32]) >> (t % 32)) & 1:
            return False
        matcher.advance(t)
    return matcher.accepting()


def arithmetic(s: str) -> bool:
    """Whether ``s`` is in ARITH's language (a recursive-descent parser, the grammar's twin)."""
    pos = 0

    def factor():
        nonlocal pos
        if pos < len(s) and s[pos].isdigit():
            while pos < len(s) and s[pos].isdigit():
                pos += 1
            return True
        if pos < len(s) and s[pos] == "(":
            pos += 1
            if not expr() or pos >= len(s) or s[pos] != ")":
                return False
            pos += 1
            return True
        return False

    def chain(item, ops):
        nonlocal pos
        if not item():
            return False
        while pos < len(s) and s[pos] in ops:
            pos += 1
            if not item():
                return False
        return True

    def term():
        return chain(factor, "*/")

    def expr():
        return chain(term, "+-")

    return expr() and pos == len(s)
