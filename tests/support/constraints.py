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
