"""``python -m minigpt.viz``: attention maps of a model, and plots of training runs.

    python -m minigpt.viz attention --ckpt-path outputs/.../checkpoints/last.ckpt --prompt "..." \\
        --layer 0 --out heads.png
    python -m minigpt.viz attention --pretrained path/to/gpt2 --prompt "..." --layer all
    python -m minigpt.viz runs outputs/RUN_A outputs/RUN_B --out runs.png

argparse, not Hydra: these commands read existing files named on the command line (a variable
number of run directories), compose no config and should not create a Hydra output directory
of their own inside ``outputs/``, where the run plots look for runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minigpt.errors import USER_ERROR_EXIT_CODE, UserError

DEFAULT_PROMPT = "First Citizen:\nBefore we proceed any further, hear me speak."


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.command(args)
    except (UserError, ValueError, OSError) as e:  # bad input: one line, as every entry point
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE


def attention(args) -> int:
    from minigpt.viz.attention_maps import write_attention_map

    model, tokenizer, source = _load_model(args)
    prompt = Path(args.prompt_file).read_text() if args.prompt_file else args.prompt
    print(write_attention_map(model, tokenizer, tokenizer.encode(prompt), args.out, args.layer,
                              source))
    return 0


def runs(args) -> int:
    from minigpt.viz.run_plots import load_run, plot_runs, summary

    labels = args.labels or [None] * len(args.run_dirs)
    if len(labels) != len(args.run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(args.run_dirs)} run directories")
    loaded = [load_run(d, name) for d, name in zip(args.run_dirs, labels, strict=True)]
    for run in loaded:
        print(summary(run))
    width, height = plot_runs(loaded, args.out, args.title)
    print(f"wrote {args.out} ({width}x{height} px, {len(loaded)} runs)")
    return 0


def _load_model(args):
    """(model, tokenizer, description) from --pretrained, --ckpt-path, or the newest checkpoint,
    on --device in --dtype (``minigpt.inference``, as generate.py loads), with the decoding
    speedups on the CPU (the maps and decoding agree within the weights' rounding)."""
    from minigpt.inference import load_for_inference

    try:
        loaded = load_for_inference(args.ckpt_path, args.pretrained, device=args.device,
                                    dtype=args.dtype)
    except FileNotFoundError as e:  # its hint names generate.py's options; name ours
        if args.ckpt_path or args.pretrained:
            raise
        where = str(e).split(";")[0]
        raise FileNotFoundError(f"{where}; train one with `python train.py`, or pass "
                                "--ckpt-path PATH or --pretrained DIR") from None
    applied = loaded.place(cpu_speedups=args.cpu_speedups != "false")
    print(f"{loaded.describe()}; cpu speedups: {', '.join(applied) or 'none apply'}",
          file=sys.stderr)
    source = loaded.source
    return loaded.model, loaded.tokenizer, Path(source).name if args.ckpt_path else source


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m minigpt.viz",
        description="Attention maps of a model, and plots of training runs (PNG files).")
    sub = parser.add_subparsers(required=True, metavar="{attention,runs}")

    p = sub.add_parser("attention", help="heatmaps of a model's attention weights for a prompt")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--ckpt-path",
                        help="a training checkpoint (default: the newest under outputs/)")
    source.add_argument("--pretrained", help="a Hugging Face GPT-2 directory")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=DEFAULT_PROMPT,
                        help="text to look at (default: the opening line of Coriolanus)")
    prompt.add_argument("--prompt-file", help="read the prompt from this file")
    p.add_argument("--layer", default="0",
                   help="a layer index: one heatmap per head; or 'all': one per layer, mean of "
                        "heads (default: 0)")
    p.add_argument("--out", default="attention.png", help="PNG to write (default: attention.png)")
    p.add_argument("--cpu-speedups", choices=("auto", "false"), default="auto",
                   help="on the CPU, oneDNN-packed linear weights (minigpt.cpu; default: auto)")
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:N, mps; auto: cuda if there is a GPU (default: auto)")
    p.add_argument("--dtype", default="auto",
                   help="the weights' type: float32, bfloat16, float16; auto: bfloat16 where the "
                        "hardware multiplies it natively, float16 on older GPUs, else float32 "
                        "(default: auto)")
    p.set_defaults(command=attention)

    p = sub.add_parser("runs", help="loss, learning rate and tokens/s of one or more runs")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="a run directory (Hydra's, under outputs/) with a CSV or wandb log")
    p.add_argument("--labels", nargs="+", help="legend names, one per run (default: the paths)")
    p.add_argument("--title", help="figure title")
    p.add_argument("--out", default="runs.png", help="PNG to write (default: runs.png)")
    p.set_defaults(command=runs)
    return parser


if __name__ == "__main__":
    sys.exit(main())
