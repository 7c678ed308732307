"""``python -m minigpt.viz attention|runs [key=value ...]`` (configs/viz.yaml; README): the first
argument is the command, the bare arguments after ``runs`` are run directories, and
``runs=a,b`` / ``labels=a,b`` are lists. Hydra neither changes directory nor writes outputs here.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from minigpt.config import VizSchema, config_errors, register_schemas, settings_problems, typed
from minigpt.errors import ConfigError
from minigpt.paths import check_paths

DEFAULT_PROMPT = "First Citizen:\nBefore we proceed any further, hear me speak."
COMMANDS = ("attention", "runs")
LIST_KEYS = ("runs", "labels")  # key=a,b is the list [a, b]
# The options of the argparse command line this one replaced, by their key now.
OLD_OPTIONS = {f"--{key.replace('_', '-')}": key for key in (
    "ckpt_path", "pretrained", "prompt", "prompt_file", "layer", "out", "cpu_speedups", "device",
    "dtype", "labels", "title")}

register_schemas()  # configs/viz.yaml names its schema (minigpt/config/schema.py)


def run(cfg: VizSchema | DictConfig) -> str:
    """Draw what ``cfg.command`` says into ``cfg.out``; return the report printed for it."""
    cfg = typed(cfg, VizSchema)
    _check_options(cfg)
    check_paths(cfg)  # runs, prompt_file, out, ...: before any model or log is read
    return attention(cfg) if cfg.command == "attention" else runs(cfg)


def attention(cfg: VizSchema) -> str:
    from minigpt.files import text_lines
    from minigpt.inference import load_for_inference
    from minigpt.viz.attention_maps import write_attention_map

    loaded = load_for_inference(cfg.ckpt_path, cfg.pretrained, cfg.checkpoints_root,
                                device=cfg.device, dtype=cfg.dtype)
    applied = loaded.place(cpu_speedups=cfg.cpu_speedups is not False)
    print(f"{loaded.describe()}; cpu speedups: {', '.join(applied) or 'none apply'}",
          file=sys.stderr)
    if cfg.prompt_file is not None:  # binary or undecodable content: named by file and line
        prompt = "".join(line for _, line in text_lines(cfg.prompt_file))
    else:
        prompt = DEFAULT_PROMPT if cfg.prompt is None else cfg.prompt
    return write_attention_map(loaded.model, loaded.tokenizer, loaded.tokenizer.encode(prompt),
                               cfg.out or "attention.png", cfg.layer,
                               Path(loaded.source).name if cfg.ckpt_path else loaded.source)


def runs(cfg: VizSchema) -> str:
    from minigpt.viz.run_plots import load_run, plot_runs, summary

    labels = cfg.labels or [None] * len(cfg.runs)
    loaded = [load_run(d, name) for d, name in zip(cfg.runs, labels, strict=True)]
    out = cfg.out or "runs.png"
    width, height = plot_runs(loaded, out, cfg.title)
    return "\n".join([*map(summary, loaded), f"wrote {out} ({width}x{height} px, "
                                               f"{len(loaded)} runs)"])


def _check_options(cfg: VizSchema) -> None:
    """Every bad value at once: the schema's types and rules, then the rules across fields."""
    problems = settings_problems(cfg)
    if cfg.prompt is not None and cfg.prompt_file is not None:
        problems.append("give prompt or prompt_file, not both")
    if cfg.command == "runs" and not cfg.runs:
        problems.append("runs needs run directories: python -m minigpt.viz runs outputs/<run> ...")
    if cfg.command == "runs" and cfg.labels is not None and len(cfg.labels) != len(cfg.runs):
        problems.append(f"{len(cfg.labels)} labels for {len(cfg.runs)} run directories: give "
                        "one label per run")
    if problems:
        raise ConfigError("; ".join(problems))


def viz_arguments(argv: list[str]) -> list[str]:
    """``runs A B labels=x,y`` -> ``command=runs runs=['A','B'] labels=['x','y']``; an old
    ``--option`` is one ``ConfigError`` naming its key."""
    args = list(argv)
    for arg in args:
        option = arg.split("=")[0]
        if option in OLD_OPTIONS:
            raise ConfigError(f"{option}: python -m minigpt.viz takes key=value settings "
                              f"(configs/viz.yaml): write {OLD_OPTIONS[option]}=...")
    if args and "=" not in args[0] and not args[0].startswith("-") and args[0] not in COMMANDS:
        near = difflib.get_close_matches(args[0], COMMANDS, n=1, cutoff=0.6)
        raise ConfigError(f"unknown command {args[0]!r}: " + (
            f"did you mean {near[0]}?" if near else "python -m minigpt.viz attention|runs ..."))
    lists = {key: [] for key in LIST_KEYS}
    if args and args[0] in COMMANDS:
        args[0] = f"command={args[0]}"
        while args[0] == "command=runs" and len(args) > 1 and "=" not in args[1] \
                and not args[1].startswith("-"):
            lists["runs"].append(args.pop(1))  # run directories
    rest = []
    for arg in args:
        key, _, value = arg.partition("=")
        if key in LIST_KEYS and value and not value.startswith(("[", "'", '"')):
            lists[key] += value.split(",")
        else:
            rest.append(arg)
    return rest + [f"{key}=[{','.join(map(_quoted, values))}]"
                   for key, values in lists.items() if values]


def _quoted(value: str) -> str:
    """``value`` as a quoted string of Hydra's override grammar."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


@hydra.main(config_path="../../configs", config_name="viz", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from minigpt.errors import command_line_errors

    with command_line_errors(ValueError, OSError):
        print(run(typed(cfg, VizSchema)))


if __name__ == "__main__":
    from minigpt.errors import one_line_errors

    with one_line_errors():
        sys.argv[1:] = viz_arguments(sys.argv[1:])
    with config_errors(VizSchema):  # a bad key or value while composing: one line, status 2
        main()
