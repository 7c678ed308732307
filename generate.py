"""Sample from a trained GPT: ``python generate.py [key=value ...]`` (see configs/generate.yaml).

A thin Hydra entry point: load a checkpoint or a Hugging Face GPT-2 directory
(``minigpt.inference``, the loader eval and viz share), encode the prompt, sample with the KV cache (``minigpt.sampling``),
decode and print. Samples go to stdout, everything else to stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from minigpt.config import GenerateSchema, config_errors, register_schemas, settings_problems, typed
from minigpt.files import TextFileError, text_lines
from minigpt.paths import check_paths

SEPARATOR = "\n---------------\n"


def run(cfg: GenerateSchema | DictConfig, out=sys.stdout) -> list[str]:
    """Generate ``cfg.num_samples`` samples of each prompt (``prompt``, or one per line of
    ``prompts=@file.txt``, all sampled as one left-padded batch); print them to ``out`` and
    return their text (prompt + continuation, without the end-of-text token). ``cfg``: the
    typed config (a composed one is converted)."""
    import torch

    from minigpt.inference import load_for_inference
    from minigpt.sampling import generate, pad_prompts, validate_sampling

    cfg = typed(cfg, GenerateSchema)

    validate_sampling(cfg.temperature, cfg.top_k, cfg.top_p)  # fail before loading anything
    _check_options(cfg)
    check_paths(cfg)  # every path given (prompt files, chat_input, chat_output, ...) first
    if cfg.chat:
        from minigpt.chat.cli import run_chat

        run_chat(cfg, out)
        return []
    prompts = _read_prompts(cfg)
    loaded = load_for_inference(cfg.ckpt_path, cfg.pretrained, cfg.checkpoints_root,
                                device=cfg.device, dtype=cfg.dtype)
    model, tokenizer, source, device = loaded.model, loaded.tokenizer, loaded.source, loaded.device
    ctx = model.config.context_length
    ids = [tokenizer.encode(p) for p in prompts]  # the char tokenizer names unknown characters
    if cfg.attention_map:  # before packing: the maps need the plain float32 layers
        from minigpt.viz.attention_maps import write_attention_map

        if not ids[0]:
            raise ValueError("attention_map needs a prompt: give prompt=... or prompt_file=...")
        _info(write_attention_map(model, tokenizer, ids[0][-ctx:], cfg.attention_map,
                                  cfg.attention_layer, source))
    # auto: compiled on a GPU; eager on the CPU, where the compiled step decodes fastest per
    # token but repays its compile time only after hundreds to thousands of tokens
    # (bench/README.md)
    compiled = cfg.decoder == "compiled" or (cfg.decoder == "auto" and device.startswith("cuda"))
    applied = loaded.place(cpu_speedups=cfg.cpu_speedups is not False, traceable=compiled)
    rows = [_prompt_window(row, tokenizer.eot_id, ctx, model.unbounded)
            for row in ids for _ in range(cfg.num_samples)]
    _info(f"{loaded.describe()}, {'compiled' if compiled else 'eager'} decoder; "
          f"cpu speedups: {', '.join(applied) or 'none'}; {len(prompts)} prompt(s) x "
          f"{cfg.num_samples} sample(s) of up to {cfg.max_new_tokens} tokens")

    stream = len(rows) == 1 if cfg.stream is None else bool(cfg.stream)
    eos_id = tokenizer.eot_id if cfg.stop_at_eot else None
    printer = _StreamPrinter(tokenizer, out, eos_id) if stream else None
    idx, padding = pad_prompts(rows, tokenizer.eot_id, device=device)  # left-padded (B, T)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    decoder = None
    if compiled:  # fixed-shape cache, one CUDA graph per token on a GPU (minigpt.static_decoding)
        from minigpt.static_decoding import StaticDecoder

        decoder = StaticDecoder(model, len(rows), compile=True,
                                capacity=idx.shape[1] + cfg.max_new_tokens)
    if printer is not None:
        out.write(prompts[0])
        out.flush()
    tokens = generate(model, idx, cfg.max_new_tokens, temperature=cfg.temperature,
                      top_k=cfg.top_k, top_p=cfg.top_p, eos_id=eos_id, generator=generator,
                      on_token=printer, vocab_size=tokenizer.vocab_size, crop_to=cfg.crop_to,
                      decoder=decoder, key_padding_mask=padding if padding.any() else None)

    texts = _decode_rows(tokenizer, tokens[:, idx.shape[1]:], eos_id)
    samples = [prompts[row // cfg.num_samples] + text for row, text in enumerate(texts)]
    if printer is not None:
        printer.finish()
    else:
        out.write(SEPARATOR.join(samples) + "\n")
    out.flush()
    return samples


def _prompt_window(ids: list[int], eot_id: int, ctx: int, unbounded: bool) -> list[int]:
    """The tokens a prompt conditions on: an empty prompt starts a new document (end of text);
    a prompt longer than the context keeps its last ``ctx`` tokens (rope + window models read
    any length)."""
    start = ids or [eot_id]
    if len(start) > ctx and not unbounded:
        _info(f"prompt has {len(start)} tokens but the model sees at most context_length={ctx}: "
              f"conditioning on the last {ctx}")
        start = start[-ctx:]
    return start


def _decode_rows(tokenizer, tokens, eos_id: int | None) -> list[str]:
    """Each row's text, up to (not including) its first ``eos_id``."""
    texts = []
    for row in tokens.tolist():
        if eos_id is not None and eos_id in row:
            row = row[:row.index(eos_id)]
        texts.append(tokenizer.decode(row))
    return texts


def _check_options(cfg: GenerateSchema) -> None:
    """Every bad value at once: the schema's types and rules, then the rules across fields."""
    problems = settings_problems(cfg)
    if sum([bool(cfg.prompt), cfg.prompt_file is not None, cfg.prompts is not None]) > 1:
        problems.append("give one of prompt, prompt_file and prompts")
    if cfg.prompts is not None and cfg.attention_map:
        problems.append("attention_map draws one prompt: give prompt=..., not prompts")
    problems += _chat_problems(cfg)
    if problems:
        raise ValueError("; ".join(problems))


def _chat_problems(cfg: GenerateSchema) -> list[str]:
    """The options chat mode does not combine with, and the chat_* options it needs."""
    if not cfg.chat:
        given = [k for k in ("chat_input", "chat_output", "chat_template")
                 if getattr(cfg, k) is not None]
        return [f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for chat mode: add "
                "chat=true"] if given else []
    given = {"prompt": bool(cfg.prompt), "prompt_file": cfg.prompt_file is not None,
             "prompts": cfg.prompts is not None, "attention_map": bool(cfg.attention_map)}
    problems = [f"{key}= is not read in chat mode (a chat turn is the user's message): drop it"
                for key, used in given.items() if used]
    if cfg.num_samples != 1:
        problems.append(f"num_samples={cfg.num_samples}: chat replies once per turn; drop it")
    if cfg.decoder == "compiled":
        problems.append("decoder=compiled: chat decodes with the eager KV cache; drop it")
    if cfg.chat_output is not None and cfg.chat_input is None:
        problems.append("chat_output= writes the replies to chat_input=FILE.jsonl: give both")
    return problems


def _read_prompts(cfg: DictConfig) -> list[str]:
    """The prompt (``prompt`` text, ``prompt=@file.txt`` or ``prompt_file``), or the prompts of
    ``prompts=@file.txt``: one per line, blank lines skipped."""
    if cfg.prompts is None:
        text = "" if cfg.prompt is None else str(cfg.prompt)
        path = cfg.prompt_file if cfg.prompt_file is not None else \
            (text[1:] if text.startswith("@") else None)
        return [text if path is None else _read_file(path)]
    text = str(cfg.prompts)
    if not text.startswith("@"):
        raise ValueError(f"prompts={text!r} must name a file, prompts=@path/to/prompts.txt "
                         "(one prompt per line)")
    prompts = [line for line in _read_file(text[1:]).splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {text[1:]} holds no prompt; write one prompt per line")
    return prompts


def _read_file(path) -> str:
    """A prompt file's UTF-8 text (newlines as \\n); binary or undecodable content is named by
    file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} not found")
    try:
        text = "".join(line for _, line in text_lines(path))
    except TextFileError as e:
        raise TextFileError(f"prompt file {e}; a prompt file holds UTF-8 text") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # as reading in text mode does


class _StreamPrinter:
    """``on_token`` callback for one sample: print each token's text as soon as it is complete
    (``minigpt.chat.session.TextStream``: a BPE token can end inside a multi-byte character)."""

    def __init__(self, tokenizer, out, eos_id: int | None):
        from minigpt.chat.session import TextStream

        self.text, self.out, self.eos_id = TextStream(tokenizer.decode), out, eos_id
        self.done = False

    def __call__(self, token) -> None:
        token = int(token[0])
        if self.done or token == self.eos_id:
            self.done = True
            return
        self._write(self.text.push(token))

    def finish(self) -> None:
        self._write(self.text.flush())
        self.out.write("\n")

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


def _info(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


register_schemas()  # configs/generate.yaml names its schema (minigpt/config/schema.py)


@hydra.main(config_path="configs", config_name="generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from minigpt.errors import one_line_errors

    try:
        # Bad input: one line and exit status 2. Sampling options and hub downloads report as
        # ValueError / OSError; other exceptions are bugs and keep their traceback.
        with one_line_errors(ValueError, OSError):
            run(typed(cfg, GenerateSchema))  # the typed config, from here on
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    with config_errors(GenerateSchema):  # a bad key or value while composing: one line, status 2
        main()
