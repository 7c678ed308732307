"""``python -m minigpt.serve [key=value ...]`` (see configs/serve.yaml).

A thin Hydra entry point, like generate.py: load the model, serve it until SIGTERM or Ctrl-C.
Bad input is one line and exit status 2. Hydra neither changes directory nor writes files.
"""

import sys

import hydra
from omegaconf import DictConfig

from minigpt.config import config_errors, typed
from minigpt.serve.config import ServeSchema, register_serve_schema

register_serve_schema()  # configs/serve.yaml names its schema (minigpt/serve/config.py)


@hydra.main(config_path="../../configs", config_name="serve", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from minigpt.errors import command_line_errors
    from minigpt.serve.server import run

    # Bad input: one line and exit status 2; other exceptions are bugs and keep their traceback.
    with command_line_errors(ValueError, OSError):
        run(typed(cfg, ServeSchema))


if __name__ == "__main__":
    with config_errors(ServeSchema):  # a bad key or value while composing: one line, status 2
        main()
    sys.exit(0)
