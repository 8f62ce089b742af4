"""The tokenizer's error for bad configuration, below every other tokenizer module so that any of them can raise it."""


class TokenizerConfigError(ValueError):
    """A tokenizer config value is invalid; the message names the key, the value and the fix."""
