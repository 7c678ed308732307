"""Every config key that takes a dotted path (``minigpt.dotted.EXTENSION_POINTS``) answers a
path that names nothing, or the wrong kind of object, in one line naming the key; and the
user's code fails at its first use in one line too: a data source that raises, returns no
iterable or yields nothing, an optimizer class its arguments do not build, a task without its
methods."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from minigpt.config import OptimSchema
from minigpt.data.config import DataConfig, DataError
from minigpt.dotted import EXTENSION_POINTS, ExtensionError
from minigpt.eval.task import Task
from minigpt.eval.training import task_class
from minigpt.model import GPT, GPTConfig
from minigpt.train.optim import main_optimizer

KEYS = {"data.source", "optim.optimizer", "optim.matrix_optimizer", "task"}
MINIGPT = Path(__file__).resolve().parents[1] / "minigpt"


def test_every_dotted_path_enters_through_an_extension_point():
    """Only minigpt.dotted imports what a path names, so a key added later that takes a dotted
    path is an extension point, and the walk below covers it."""
    importers = [p.relative_to(MINIGPT.parent).as_posix() for p in MINIGPT.rglob("*.py")
                 if re.search(r"\b(get_object|get_class|get_method|instantiate|named_object)\(",
                              p.read_text()) and p.name != "dotted.py"]
    assert importers == []
    assert set(EXTENSION_POINTS) == KEYS


@pytest.mark.parametrize("key", sorted(KEYS))
@pytest.mark.parametrize(("path", "why"), [
    ("no_such_module.thing", "ModuleNotFoundError: No module named 'no_such_module'"),
    ("math.pi", "not callable|not a torch.optim.Optimizer subclass|not a minigpt.eval.task.Task "
                "subclass"),
])
def test_each_key_names_itself_and_the_path_in_one_line(key, path, why):
    point = EXTENSION_POINTS[key]
    with pytest.raises(ExtensionError) as refused:
        point.load(path)
    message = str(refused.value)
    assert "\n" not in message
    assert re.match(rf"{re.escape(key)}='{re.escape(path)}' is not {point.kind} \(({why})\): "
                    rf"{re.escape(point.fix)}$", message), message


# ---- a user's code at its first use -----------------------------------------------------------

def returns_a_number(**kwargs):
    return 5


def yields_nothing(**kwargs):
    yield from ()


def raises_inside(**kwargs):
    raise RuntimeError("the corpus server is down")


class Hollow(Task):
    """A task that forgot its methods."""


class NoGroups(torch.optim.Optimizer):
    def __init__(self, params, lr):
        raise ValueError("NoGroups takes no parameter groups")


def _source(name: str) -> DataConfig:
    return DataConfig(name="user", source=f"{__name__}.{name}", tokenizer="char")


@pytest.mark.parametrize(("name", "message"), [
    ("returns_a_number", "^data.source={mod}.returns_a_number returned an int, not an iterable "
                         "of documents \\(str\\): use shakespeare"),
    ("yields_nothing", "^data.source={mod}.yields_nothing yielded no documents \\(when called "
                       "with data.source_args={{}}\\)"),
    ("raises_inside", "^data.source={mod}.raises_inside failed when called with "
                      "data.source_args={{}}: RuntimeError: the corpus server is down \\(raised "
                      "at .*test_dotted.py:\\d+\\): fix that code"),
])
def test_a_data_source_at_its_first_use(name, message):
    from minigpt.data.sources import source_for

    config = _source(name)
    with pytest.raises(DataError if name == "yields_nothing" else ExtensionError,
                       match=message.format(mod=re.escape(__name__))) as refused:
        source_for(config).load(config)
    assert "\n" not in str(refused.value)


def test_an_optimizer_its_arguments_do_not_build_is_one_line_naming_the_key():
    model = GPT(GPTConfig(vocab_size=64, context_length=8, n_layer=2, n_head=2, n_embd=32))
    with pytest.raises(ExtensionError, match=r"^optim.optimizer=torch.optim.LBFGS failed when "
                                             r"built with lr and .*: ValueError: LBFGS doesn't "
                                             r"support per-parameter options"):
        main_optimizer(model, OptimSchema(optimizer="torch.optim.LBFGS", decay_steps=10),
                       fused=False)
    with pytest.raises(ExtensionError, match=rf"^optim.optimizer={__name__}.NoGroups failed .*"
                                             r"NoGroups takes no parameter groups \(raised at "):
        main_optimizer(model, OptimSchema(optimizer=f"{__name__}.NoGroups", decay_steps=10),
                       fused=False)


def test_a_task_without_its_methods_is_refused_by_the_key_that_named_it():
    with pytest.raises(ExtensionError, match=rf"^eval.tasks='{__name__}.Hollow' is not an "
                                             r"evaluation task \(a Task subclass without items, "
                                             r"requests, item_metrics of its own\)"):
        task_class(f"{__name__}.Hollow", "eval.tasks")
