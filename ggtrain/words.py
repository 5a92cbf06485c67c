"""Counted nouns in what commands print (layer 0): "1 update", "1,000 updates"."""


def count(n: int, noun: str, plural: str | None = None) -> str:
    """n with thousands separators and the noun, singular for exactly one ('1 window', '0 windows');
    plural: the plural where it is not noun + 's'."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
