"""``python -m minigpt.eval [harness] [key=value ...]`` (see configs/eval.yaml).

``harness`` as the first argument is ``task=harness``; ``tasks=a,b`` is a list. Hydra neither
changes directory nor writes outputs here.
"""

import sys

import hydra
from omegaconf import DictConfig

from minigpt.config import EvalCommandSchema, config_errors, register_schemas, typed

register_schemas()  # configs/eval.yaml names its schema (minigpt/config/schema.py)


def harness_arguments(argv: list[str]) -> list[str]:
    """``harness tasks=a,b`` -> ``task=harness tasks=[a,b]``; other arguments unchanged."""
    args = list(argv)
    if args and args[0] == "harness":
        args[0] = "task=harness"
    return [f"tasks=[{a[6:]}]" if a.startswith("tasks=") and "," in a
            and not a[6:].startswith(("[", "'", '"')) else a for a in args]


@hydra.main(config_path="../../configs", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from minigpt.errors import command_line_errors
    from minigpt.eval.run import run

    with command_line_errors(ValueError, OSError):  # downloads, a model that cannot read the text
        run(typed(cfg, EvalCommandSchema))


if __name__ == "__main__":
    sys.argv[1:] = harness_arguments(sys.argv[1:])
    with config_errors(EvalCommandSchema):  # a bad key or value while composing: one line
        main()
