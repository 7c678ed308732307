"""``python -m minigpt.data data=<name> [overrides]``: prepare one dataset's token files.

A utility, not a run: Hydra neither changes directory nor writes outputs/ or logs here.
"""

import sys

import hydra
from omegaconf import DictConfig

from minigpt.data.config import DataError
from minigpt.data.prepare import prepare_dataset
from minigpt.tokenizer import TokenizerUnavailableError


@hydra.main(config_path="../../configs", config_name="prepare", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        meta = prepare_dataset(cfg.data, cfg.data_root)
    except (DataError, FileNotFoundError, TokenizerUnavailableError) as e:
        sys.exit(f"error: {e}")
    directory = f"{cfg.data_root}/{meta['name']}"
    print(f"{directory}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
          f"({meta['dtype']}, tokenizer {meta['tokenizer']['name']}, vocab {meta['vocab_size']:,}, "
          f"{meta['documents']:,} documents, fingerprint {meta['fingerprint']})")


if __name__ == "__main__":
    main()
