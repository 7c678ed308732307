"""Sample from a trained GPT: ``python generate.py [key=value ...]`` (see configs/generate.yaml).

A thin Hydra entry point: load a checkpoint (``minigpt.checkpoint``) or a Hugging Face GPT-2
directory (``minigpt.hf``), encode the prompt, sample with the KV cache (``minigpt.sampling``),
decode and print. Samples go to stdout, everything else to stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from minigpt.config_schema import GenerateSchema, check_keys, config_errors, register_schemas
from minigpt.files import TextFileError, text_lines

DTYPES = ("auto", "float32", "bfloat16", "float16")
DECODERS = ("auto", "eager", "compiled")
SEPARATOR = "\n---------------\n"


def run(cfg: DictConfig, out=sys.stdout) -> list[str]:
    """Generate ``cfg.num_samples`` samples of each prompt (``prompt``, or one per line of
    ``prompts=@file.txt``, all sampled as one left-padded batch); print them to ``out`` and
    return their text (prompt + continuation, without the end-of-text token)."""
    import torch

    from minigpt.checkpoint import load_model
    from minigpt.sampling import generate, pad_prompts, validate_sampling

    validate_sampling(cfg.temperature, cfg.top_k, cfg.top_p)  # fail before loading anything
    _check_options(cfg)
    prompts = _read_prompts(cfg)
    device = pick_device(cfg.device)
    dtype = decoding_dtype(cfg.dtype, device)
    model, tokenizer, source = load_model(cfg.ckpt_path, cfg.pretrained, cfg.checkpoints_root)
    ctx, num_params = model.config.context_length, model.num_params()
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but the "
                         f"model only {model.config.vocab_size}")
    ids = [tokenizer.encode(p) for p in prompts]  # the char tokenizer names unknown characters
    if cfg.attention_map:  # before packing: the maps need the plain float32 layers
        from minigpt.viz.attention_maps import write_attention_map

        if not ids[0]:
            raise ValueError("attention_map needs a prompt: give prompt=... or prompt_file=...")
        _info(write_attention_map(model, tokenizer, ids[0][-ctx:], cfg.attention_map,
                                  cfg.attention_layer, source))
    compiled = cfg.decoder == "compiled" or (cfg.decoder == "auto" and device.startswith("cuda"))
    # torch.compile cannot trace minigpt.cpu's oneDNN ops; inductor packs CPU weights itself
    applied = place_model(model, device, getattr(torch, dtype),
                          cfg.cpu_speedups if not compiled else False)
    rows = [_prompt_window(row, tokenizer.eot_id, ctx, model.unbounded)
            for row in ids for _ in range(cfg.num_samples)]
    _info(f"{source}: {num_params / 1e6:.2f}M parameters, tokenizer {tokenizer.name!r}, "
          f"context {ctx}, {device} {dtype}, {'compiled' if compiled else 'eager'} decoder; "
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

        decoder = StaticDecoder(model, len(rows), compile=True)
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


def decoding_dtype(name: str, device: str) -> str:
    """``dtype=auto``: bfloat16 weights on a GPU that multiplies bf16 natively (float16 on older
    ones), float32 on the CPU. On a GPU, float32 matmuls that remain use TF32 (this process)."""
    import torch

    on_gpu = str(device).startswith("cuda")
    if on_gpu:
        torch.set_float32_matmul_precision("high")
    if name != "auto":
        return name
    if not on_gpu:
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"


def place_model(model, device: str, dtype, cpu_speedups) -> list[str]:
    """Move ``model`` to ``device`` in ``dtype``; on the CPU (``cpu_speedups=auto``) pack its
    linear weights in that dtype instead, activations staying float32. What was applied."""
    import torch

    model.to(device)
    applied = []
    if cpu_speedups is not False and dtype in (torch.float32, torch.bfloat16):
        from minigpt.cpu import speed_up_decoding

        applied = speed_up_decoding(model, weight_dtype=dtype)
    if not applied:
        model.to(dtype)
    return applied


def pick_device(name: str) -> str:
    """``device=auto``: cuda if this machine has a GPU, else cpu; any other name as given, once
    checked to exist here (else one line naming the setting and what this machine offers)."""
    import torch

    from minigpt.errors import UserError

    gpus = torch.cuda.device_count()
    if name == "auto":
        return "cuda" if gpus else "cpu"
    mps = torch.backends.mps.is_available()
    offers = "device=cpu" + (f", device=cuda (or cuda:0 .. cuda:{gpus - 1})" if gpus else "") \
        + (", device=mps" if mps else "") + " or device=auto"
    try:
        kind = torch.device(str(name))
    except (RuntimeError, TypeError, ValueError):
        raise UserError(f"device={name!r} is not a device name; this machine offers "
                        f"{offers}") from None
    if kind.type == "cpu" or (kind.type == "mps" and mps) or \
            (kind.type == "cuda" and (kind.index or 0) < gpus):
        return str(name)
    has = f"{gpus} CUDA GPU(s)" if gpus else "no CUDA GPU" + (
        f" (this torch {torch.__version__} is built without CUDA)" if torch.version.cuda is None
        else "")
    raise UserError(f"device={name!r} is not on this machine, which has {has}; it offers "
                    f"{offers}")


def _decode_rows(tokenizer, tokens, eos_id: int | None) -> list[str]:
    """Each row's text, up to (not including) its first ``eos_id``."""
    texts = []
    for row in tokens.tolist():
        if eos_id is not None and eos_id in row:
            row = row[:row.index(eos_id)]
        texts.append(tokenizer.decode(row))
    return texts


def _check_options(cfg: DictConfig) -> None:
    problems = []
    for name in ("max_new_tokens", "num_samples", "seed"):
        value, low = cfg[name], 0 if name != "num_samples" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            problems.append(f"{name}={value!r} must be an integer >= {low}")
    if cfg.cpu_speedups not in ("auto", False):
        problems.append(f"cpu_speedups={cfg.cpu_speedups!r} must be auto or false")
    if cfg.decoder not in DECODERS:
        problems.append(f"decoder={cfg.decoder!r} must be one of {DECODERS}")
    if cfg.dtype not in DTYPES:
        problems.append(f"dtype={cfg.dtype!r} must be one of {DTYPES}")
    if cfg.ckpt_path is not None and cfg.pretrained is not None:
        problems.append("give ckpt_path or pretrained, not both")
    if sum([bool(cfg.prompt), cfg.prompt_file is not None, cfg.prompts is not None]) > 1:
        problems.append("give one of prompt, prompt_file and prompts")
    if cfg.prompts is not None and cfg.attention_map:
        problems.append("attention_map draws one prompt: give prompt=..., not prompts")
    if problems:
        raise ValueError("; ".join(problems))


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
    (a BPE token can end inside a multi-byte character; its text waits for the next one)."""

    def __init__(self, tokenizer, out, eos_id: int | None):
        self.tokenizer, self.out, self.eos_id = tokenizer, out, eos_id
        self.ids: list[int] = []
        self.printed = 0
        self.done = False

    def __call__(self, token) -> None:
        token = int(token[0])
        if self.done or token == self.eos_id:
            self.done = True
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self._write(text)

    def finish(self) -> None:
        self._write(self.tokenizer.decode(self.ids))
        self.out.write("\n")

    def _write(self, text: str) -> None:
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)


def _info(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


register_schemas()  # configs/generate.yaml names its schema (minigpt/config_schema.py)


@hydra.main(config_path="configs", config_name="generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from minigpt.errors import one_line_errors

    try:
        # Bad input: one line and exit status 2. Sampling options and hub downloads report as
        # ValueError / OSError; other exceptions are bugs and keep their traceback.
        with one_line_errors(ValueError, OSError):
            check_keys(cfg, GenerateSchema)  # keys added with + that the schema lacks
            run(cfg)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    with config_errors(GenerateSchema):  # a bad key or value while composing: one line, status 2
        main()
