"""``python -m minigpt.data data=<name> [overrides]``: prepare one dataset's token files (Hydra
neither changes directory nor writes outputs here)."""

import hydra
from omegaconf import DictConfig

from minigpt.config import PrepareSchema, config_errors, register_schemas, typed
from minigpt.data.prepare import prepare_dataset
from minigpt.errors import one_line_errors
from minigpt.paths import check_paths

register_schemas()  # configs/prepare.yaml and data/*.yaml name their schemas


@hydra.main(config_path="../../configs", config_name="prepare", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with one_line_errors():
        prepare = typed(cfg, PrepareSchema)
        check_paths(prepare)  # data.paths, data_root, ...: before anything is read
        meta = prepare_dataset(prepare.data, prepare.data_root)
    print(summary(f"{prepare.data_root}/{meta['name']}", meta))


def summary(directory: str, meta: dict) -> str:
    """One line about a prepared dataset; token shards (read as they are) count no documents."""
    documents = f"{meta['documents']:,} documents, " if "documents" in meta else ""
    return (f"{directory}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
            f"({meta['dtype']}, tokenizer {meta['tokenizer']['name']}, "
            f"vocab {meta['vocab_size']:,}, {documents}fingerprint {meta['fingerprint']})")


if __name__ == "__main__":
    with config_errors(PrepareSchema):  # a bad key or value while composing: one line, status 2
        main()
