"""Chat: the template that turns conversations into tokens (``template``), a multi-turn session
with a KV cache (``session``), ``generate.py chat=true`` (``cli``), and a synthetic instruction
set with exact answers (``python -m minigpt.chat.synthetic``).

Importing this package does no work; import the modules by name.
"""
