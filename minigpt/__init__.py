"""minigpt: a small, fast, readable GPT training framework built around one attention block."""

__version__ = "0.1.0"
