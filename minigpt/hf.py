"""Hugging Face GPT-2 checkpoints in and out: ``read_gpt2`` / ``write_gpt2`` convert between a
directory (``config.json`` and ``model.safetensors`` or ``pytorch_model.bin``, sharded or not)
and ``GPT``'s config fields and state dict; ``GPT.from_pretrained`` / ``save_pretrained`` call
them (this module never imports ``minigpt.model``). ``GPT2_FIELDS`` classifies every
``GPTConfig`` field for export. GPT-2's ``Conv1D`` weights are (in, out), the transpose of
``nn.Linear``'s; ``c_attn`` holds [queries | keys | values], the order of our ``qkv`` rows.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from minigpt.errors import UserError, first_line
from minigpt.files import atomic_write, load_tensors

HUB_GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2")
_HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name
_SUPPORTED_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are GELU, tanh approximation
# GPTConfig fields a caller may set freely when loading; the others are fixed by the weights.
_FREE_OVERRIDES = ("dropout", "context_length", "init_std")


@dataclass(frozen=True)
class Fixed:
    """GPT-2's block computes only ``gpt2`` (or a value ``same`` accepts, given the whole
    config): export refuses any other value, and a GPT-2 checkpoint loads with ``gpt2``."""

    gpt2: Any
    same: Callable[[dict], bool] = lambda config: False


@dataclass(frozen=True)
class Free:
    """Any value exports, written to these GPT2Config keys (none: the weights carry it)."""

    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrainingOnly:
    """Any value exports: only training reads it, the trained function is GPT-2's; a GPT-2
    checkpoint loads with ``loaded``."""

    loaded: Any


# Every GPTConfig field (tests/test_hf.py fails on one missing here, and export refuses it): a
# new block option is Fixed at its off value unless GPT-2's block computes its other values too.
GPT2_FIELDS = {
    "vocab_size": Free(("vocab_size",)),
    "context_length": Free(("n_positions", "n_ctx")),
    "n_layer": Free(("n_layer",)),
    "n_head": Free(("n_head",)),
    "n_embd": Free(("n_embd",)),
    "dropout": Free(("attn_pdrop", "embd_pdrop", "resid_pdrop")),
    "bias": Free(),  # GPT-2 always has biases: absent ones are written as zeros, the same function
    "qkv_bias": Free(),
    "layer_norm_eps": Free(("layer_norm_epsilon",)),
    "init_std": Free(("initializer_range",)),
    "num_kv_heads": Fixed(None, lambda c: c["num_kv_heads"] == c["n_head"]),  # as many: plain MHA
    "position": Fixed("learned"),
    "rope_theta": Fixed(10000.0, lambda c: c["position"] == "learned"),  # unused without rope
    "window": Fixed(None),
    "window_schedule": TrainingOnly(None),  # it ends at the full context: GPT-2's attention
    "norm": Fixed("layernorm"),
    "qk_norm": Fixed(False),
    "mlp": Fixed("gelu"),
    "tie_head": Fixed(True),
    "zero_init_proj": TrainingOnly(False),  # the starting weights only
    "logit_softcap": Fixed(None),
    "value_embeddings": Fixed(False),
    "document_mask": TrainingOnly(False),  # packed training rows; decoding is unchanged
}

# HF suffix (after "h.{i}.") -> ours (after "blocks.{i}."), whether it is a Conv1D weight, and
# our shape in multiples of n_embd.
_BLOCK_KEYS = {
    "ln_1.weight": ("norm1.weight", False, (1,)),
    "ln_1.bias": ("norm1.bias", False, (1,)),
    "attn.c_attn.weight": ("attn.qkv.weight", True, (3, 1)),
    "attn.c_attn.bias": ("attn.qkv.bias", False, (3,)),
    "attn.c_proj.weight": ("attn.out_proj.weight", True, (1, 1)),
    "attn.c_proj.bias": ("attn.out_proj.bias", False, (1,)),
    "ln_2.weight": ("norm2.weight", False, (1,)),
    "ln_2.bias": ("norm2.bias", False, (1,)),
    "mlp.c_fc.weight": ("mlp.fc.weight", True, (4, 1)),
    "mlp.c_fc.bias": ("mlp.fc.bias", False, (4,)),
    "mlp.c_proj.weight": ("mlp.proj.weight", True, (1, 4)),
    "mlp.c_proj.bias": ("mlp.proj.bias", False, (1,)),
}
_TOP_KEYS = {
    "wte.weight": "tok_emb.weight",
    "wpe.weight": "pos_emb.weight",
    "ln_f.weight": "final_norm.weight",
    "ln_f.bias": "final_norm.bias",
}


class PretrainedError(UserError, ValueError):
    """A Hugging Face directory minigpt cannot load: the message is one line naming the file, what
    is wrong with it and the fix."""


class HubError(UserError, OSError):
    """A hub name that could not be downloaded (offline, unknown, no network)."""


# --------------------------------------------------------------------------------------- loading


def read_gpt2(name_or_path: str | os.PathLike,
              **config_overrides) -> tuple[dict, dict[str, Tensor]]:
    """``(GPTConfig fields, float32 state dict in GPT's layout)`` of a Hugging Face GPT-2
    directory or hub name (``gpt2``, ``org/name``). ``config_overrides`` may set ``dropout``
    (default 0.0; GPT-2 trained with 0.1), ``context_length`` (at most the checkpoint's; the
    position table is cropped) and ``init_std``; other fields must match the checkpoint."""
    directory = _resolve(name_or_path)
    config = _config_from_hf(_read_json(directory / "config.json"), config_overrides,
                             where=directory / "config.json")
    files = _weight_files(directory)
    where = files[0] if len(files) == 1 else directory
    return config, _hf_to_ours(_read_weights(files, directory), config, where)


def _resolve(name_or_path: str | os.PathLike) -> Path:
    """A local checkpoint directory, downloading a hub name if it is not a local path."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face GPT-2 "
                                    "directory (config.json + model.safetensors)")
        return path
    if path.exists():
        raise PretrainedError(f"{path} is a file; pass the checkpoint directory holding "
                              "config.json and model.safetensors")
    name = str(name_or_path)
    if not is_hub_name(name):
        raise FileNotFoundError(
            f"no such checkpoint directory: {name!r} (expected a directory with config.json and "
            f"model.safetensors or pytorch_model.bin, or a hub name like 'gpt2' or 'org/name')"
        )
    return _download(name)


def is_hub_name(name: str) -> bool:
    """Whether ``name`` reads as a Hugging Face Hub model (``gpt2``, ``org/name``)."""
    return name in HUB_GPT2_NAMES or bool(_HUB_REPO_ID.match(name))


def _download(repo_id: str) -> Path:
    import huggingface_hub

    # Read the switch at call time (huggingface_hub reads it once, at import).
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        for patterns in (["config.json", "*.safetensors", "model.safetensors.index.json"],
                         ["config.json", "pytorch_model*.bin", "pytorch_model.bin.index.json"]):
            directory = Path(huggingface_hub.snapshot_download(
                repo_id, allow_patterns=patterns, local_files_only=offline))
            if _weight_files(directory):
                return directory
    except Exception as error:  # any hub, HTTP or disk failure: one actionable line, no trace
        reason = "offline: HF_HUB_OFFLINE is set and it is not in the local cache" if offline \
            else first_line(error)
        raise HubError(
            f"could not download {repo_id!r} from the Hugging Face Hub ({reason}); it is not a "
            "local directory either: pass a directory with config.json and model.safetensors"
        ) from None
    raise FileNotFoundError(f"hub repo {repo_id!r} has no model.safetensors or pytorch_model.bin")


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``, or one line naming the file and what is wrong."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bytes that are not UTF-8
        raise PretrainedError(f"{path} is not readable JSON ({first_line(e)}); copy or download "
                              "the checkpoint directory again") from None
    if not isinstance(value, dict):
        raise PretrainedError(f"{path} holds a JSON {type(value).__name__}, not an object; copy "
                              "or download the checkpoint directory again")
    return value


def _config_from_hf(hf: dict, overrides: dict, where: Path) -> dict:
    """Map a GPT2Config dict to ours, refusing variants our model does not compute."""
    problems = []
    if hf.get("model_type", "gpt2") != "gpt2":
        problems.append(f"model_type={hf.get('model_type')!r} (only 'gpt2' is supported)")
    if hf.get("activation_function", "gelu_new") not in _SUPPORTED_ACTIVATIONS:
        problems.append(f"activation_function={hf.get('activation_function')!r} "
                        f"(supported: {', '.join(_SUPPORTED_ACTIVATIONS)})")
    if hf.get("n_inner") not in (None, 4 * (hf.get("n_embd") or 0)):
        problems.append(f"n_inner={hf['n_inner']} (must be null or 4 * n_embd)")
    for key, required in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False), ("tie_word_embeddings", True)):
        if hf.get(key, required) != required:
            problems.append(f"{key}={hf[key]} (only {required} is supported)")
    if "n_positions" not in hf and "n_ctx" in hf:
        hf["n_positions"] = hf["n_ctx"]  # very old configs
    sizes = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    missing = [k for k in sizes if k not in hf]
    if missing:
        problems.append(f"missing {missing}")
    problems += [f"{k}={hf[k]!r} (must be an integer >= 1)" for k in sizes if k in hf and (
        isinstance(hf[k], bool) or not isinstance(hf[k], int) or hf[k] < 1)]
    if not problems and hf["n_embd"] % hf["n_head"]:
        problems.append(f"n_embd={hf['n_embd']} (must be a multiple of n_head={hf['n_head']})")
    if problems:
        raise PretrainedError(f"{where}: unsupported GPT-2 config: " + "; ".join(problems))

    values = dict(vocab_size=hf["vocab_size"], context_length=hf["n_positions"],
                  n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"], dropout=0.0,
                  bias=True, qkv_bias=True, layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                  init_std=hf.get("initializer_range", 0.02),
                  **{name: rule.gpt2 if isinstance(rule, Fixed) else rule.loaded
                     for name, rule in GPT2_FIELDS.items() if not isinstance(rule, Free)})
    for key, value in overrides.items():
        if key not in values:  # values holds every GPTConfig field
            raise PretrainedError(f"GPTConfig: unknown field(s) [{key!r}]; valid fields are "
                                  f"{sorted(values)}")
        if key == "context_length" and isinstance(value, int) and value > values[key]:
            raise PretrainedError(
                f"context_length={value} exceeds the checkpoint's n_positions={values[key]} "
                f"({where}): its position embeddings stop there; ask for context_length <= "
                f"{values[key]}")
        elif key not in _FREE_OVERRIDES and value != values[key]:
            raise PretrainedError(f"{key}={value!r} contradicts the checkpoint ({key}="
                                  f"{values[key]!r} in {where}); only "
                                  f"{', '.join(_FREE_OVERRIDES)} can be changed")
        values[key] = value
    return values


def _weight_files(directory: Path) -> list[Path]:
    """Weight files of a checkpoint directory, safetensors first; [] if there are none."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (directory / single).is_file():
            return [directory / single]
        if (directory / index).is_file():
            weight_map = _read_json(directory / index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                    isinstance(name, str) and "/" not in name for name in weight_map.values()):
                raise PretrainedError(f"{directory / index} has no weight_map of file names in "
                                      "this directory; copy or download it again")
            return [directory / name for name in sorted(set(weight_map.values()))]
    return []


def _read_weights(files: list[Path], directory: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    if not files:
        raise FileNotFoundError(f"{directory} has config.json but no model.safetensors or "
                                "pytorch_model.bin")
    state: dict[str, Tensor] = {}
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing (named by the index in {directory}); "
                                    "copy or download the checkpoint directory again")
        if file.suffix == ".safetensors":
            try:
                state.update(load_file(file))
            except Exception as e:  # SafetensorError, OSError: cut short, damaged or foreign
                raise PretrainedError(f"{file} is not a readable safetensors file "
                                      f"({first_line(e)}); a truncated or half-copied file reads "
                                      "like this: copy or download it again") from None
        else:  # weights_only: a pickle may hold tensors and plain containers, never code
            weights = load_tensors(file)
            if not isinstance(weights, dict) or not all(
                    isinstance(v, Tensor) for v in weights.values()):
                raise PretrainedError(f"{file} is not a state dict (a dict of tensors); copy or "
                                      "download the checkpoint directory again")
            state.update(weights)
    return state


def _hf_to_ours(hf_state: dict[str, Tensor], config: dict, where: Path) -> dict[str, Tensor]:
    """Rename and transpose a GPT-2 state dict into ``GPT``'s, checking nothing is left over and
    every shape is the one ``config`` (from config.json) implies. Keys may lack the
    ``transformer.`` prefix (``GPT2Model``, the original OpenAI upload)."""
    n_layer, context_length = config["n_layer"], config["context_length"]
    hf_state = {k.removeprefix("transformer."): v for k, v in hf_state.items()}
    lm_head = hf_state.pop("lm_head.weight", None)
    ours: dict[str, Tensor] = {}
    unexpected = []
    for key, value in hf_state.items():
        block = re.fullmatch(r"h\.(\d+)\.(.+)", key)
        if block and block.group(2) in ("attn.bias", "attn.masked_bias"):
            continue  # causal-mask buffers of older transformers versions
        if block and block.group(2) in _BLOCK_KEYS:
            name, conv1d, _ = _BLOCK_KEYS[block.group(2)]
            ours[f"blocks.{block.group(1)}.{name}"] = value.t() if conv1d else value
        elif key in _TOP_KEYS:
            ours[_TOP_KEYS[key]] = value
        else:
            unexpected.append(key)
    shapes = _expected_shapes(config)
    missing = sorted(set(shapes) - set(ours))
    unexpected += sorted(set(ours) - set(shapes))
    if missing or unexpected:
        raise PretrainedError(f"{where}: weights do not match config.json "
                              f"(n_layer={n_layer}): missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    ours["pos_emb.weight"] = ours["pos_emb.weight"][:context_length]  # maybe cropped
    for key, value in ours.items():
        expected = shapes[key]
        if tuple(value.shape) != expected:
            raise PretrainedError(
                f"{where}: {key} has shape {tuple(value.shape)}, but config.json (n_embd="
                f"{config['n_embd']}, vocab_size={config['vocab_size']}) implies {expected}: the "
                "weights and config.json are from different models; copy or download the "
                "checkpoint directory again")
    if lm_head is not None and (lm_head.shape != ours["tok_emb.weight"].shape
                                or not torch.equal(lm_head, ours["tok_emb.weight"])):
        raise PretrainedError(f"{where}: lm_head.weight differs from the token embedding; only "
                              "tied GPT-2 checkpoints are supported")
    ours = {k: v.to(torch.float32).contiguous() for k, v in ours.items()}
    ours["lm_head.weight"] = ours["tok_emb.weight"]
    return ours


def _expected_shapes(config: dict) -> dict[str, tuple]:
    """The shape config.json implies for each weight of ``GPT``'s state dict."""
    C, V = config["n_embd"], config["vocab_size"]
    shapes = {"tok_emb.weight": (V, C), "pos_emb.weight": (config["context_length"], C),
              "final_norm.weight": (C,), "final_norm.bias": (C,)}
    for i in range(config["n_layer"]):
        shapes.update({f"blocks.{i}.{name}": tuple(n * C for n in multiples)
                       for name, _, multiples in _BLOCK_KEYS.values()})
    return shapes


# --------------------------------------------------------------------------------------- saving


def write_gpt2(path: str | os.PathLike, config: dict, state: dict[str, Tensor]) -> None:
    """Write a ``GPT``'s config fields and state dict as a Hugging Face GPT-2 directory
    (``config.json`` + ``model.safetensors``, each written atomically) that ``transformers``
    loads with the same logits; absent biases are written as zeros (the same function)."""
    from safetensors.torch import save_file

    check_gpt2_export(config)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _ours_to_hf(state, config["n_embd"], config["n_layer"])
    atomic_write(directory / "model.safetensors",
                 lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    hf_config = _hf_config(config, next(iter(tensors.values())).dtype)
    atomic_write(directory / "config.json",
                 lambda tmp: tmp.write_text(json.dumps(hf_config, indent=2) + "\n"))


def check_gpt2_export(config: dict) -> None:
    """Refuse, in one line naming the field and its value, a config GPT-2's format cannot hold:
    a field ``GPT2_FIELDS`` does not classify, or a fixed field at another value."""
    for name, value in config.items():
        rule = GPT2_FIELDS.get(name)
        if rule is None:
            raise ValueError(f"cannot export {name}={value!r} to Hugging Face GPT-2: the field is "
                             "not in minigpt.hf.GPT2_FIELDS; classify it there (fixed to GPT-2's "
                             "value, free, or training-only)")
        if isinstance(rule, Fixed) and value != rule.gpt2 and not rule.same(config):
            raise ValueError(f"cannot export {name}={value!r} to Hugging Face GPT-2, whose block "
                             f"has only {name}={rule.gpt2!r}; keep the .ckpt for this model")


def _ours_to_hf(state: dict[str, Tensor], C: int, n_layer: int) -> dict[str, Tensor]:
    dtype = state["tok_emb.weight"].dtype

    def get(key: str, size: int) -> Tensor:  # an absent bias: zeros, exactly the same function
        if key not in state:
            assert key.endswith(".bias"), key
            return torch.zeros(size, dtype=dtype)
        return state[key]

    hf = {f"transformer.{hf_key}": get(key, C) for hf_key, key in _TOP_KEYS.items()}
    for i in range(n_layer):
        for hf_suffix, (suffix, conv1d, multiples) in _BLOCK_KEYS.items():
            value = get(f"blocks.{i}.{suffix}", multiples[0] * C)
            hf[f"transformer.h.{i}.{hf_suffix}"] = value.t() if conv1d else value
    # safetensors wants contiguous CPU tensors that share no memory.
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in hf.items()}


def _hf_config(config: dict, dtype: torch.dtype) -> dict:
    gpt2_vocab = config["vocab_size"] > 50256  # GPT-2's <|endoftext|> id exists
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        **{key: config[name] for name, rule in GPT2_FIELDS.items() if isinstance(rule, Free)
           for key in rule.keys},
        "n_inner": None,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": 50256 if gpt2_vocab else None,
        "eos_token_id": 50256 if gpt2_vocab else None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
