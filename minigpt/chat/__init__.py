"""Chat: the template that turns conversations into tokens (``minigpt.chat.template``), reading
conversation records (``records``), packing them into training rows (``rows``), and a synthetic
instruction set with exact answers (``python -m minigpt.chat.synthetic``).

Importing this package does no work; import the modules by name.
"""
