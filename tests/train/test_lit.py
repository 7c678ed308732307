"""minigpt.train.lit: what LitGPT puts into and takes out of a checkpoint."""

from minigpt.model import GPT, GPTConfig
from minigpt.train.lit import LitGPT, strip_compiled_prefix


def test_compiled_prefix_is_stripped_on_save_and_load():
    model = GPT(GPTConfig(vocab_size=64, context_length=8, n_layer=1, n_head=2, n_embd=16))
    lit = LitGPT(model, {}, {"type": "char"})
    clean = {"model." + k: v for k, v in model.state_dict().items()}
    compiled = {k.replace("model.", "model._orig_mod.", 1): v for k, v in clean.items()}
    assert strip_compiled_prefix(compiled).keys() == clean.keys()
    checkpoint = {"state_dict": dict(compiled)}
    lit.on_load_checkpoint(checkpoint)
    lit.load_state_dict(checkpoint["state_dict"])  # strict: loads without key surgery
    saved = {"state_dict": dict(compiled)}
    lit.on_save_checkpoint(saved)
    assert saved["state_dict"].keys() == clean.keys()
    assert saved["minigpt"]["model_config"] == model.config.to_dict()
