"""minigpt.train.activation_checkpointing and compile=blocks: the same loss and gradients as the
plain model (its own autograd is the oracle) in every mode, eager and compiled; less kept for
backward; unchanged state-dict keys; exact resume across modes; 2 gloo processes under DDP and
FSDP train like the run without checkpointing."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch._dynamo.utils import counters

from minigpt.cpu import speed_up_training
from minigpt.model import GPT, GPTConfig
from minigpt.train.activation_checkpointing import (
    ActivationCheckpointing,
    apply_activation_checkpointing,
    checkpointing_of,
)
from minigpt.train.loop import ModelWithLoss
from tests.train.test_run import (  # noqa: F401 - data_root is a fixture
    ROOT,
    LossRecorder,
    _checksums,
    _train_py,
    data_root,
    run,
    tiny_cfg,
)

MODES = [m.value for m in ActivationCheckpointing]
TINY = GPTConfig(vocab_size=64, context_length=32, n_layer=3, n_head=2, n_embd=32, dropout=0.1)


def _loss_and_grads(model, loss=None, seed=1):
    """The loss of one fixed batch and every parameter's gradient (dropout drawn from ``seed``)."""
    x = torch.randint(0, TINY.vocab_size, (3, TINY.context_length),
                      generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    value = (loss or model.loss)(x, x)
    value.backward()
    return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(got, expect):
    torch.testing.assert_close(got[0], expect[0], rtol=1e-5, atol=1e-6)
    assert got[1].keys() == expect[1].keys()
    for name in expect[1]:
        torch.testing.assert_close(got[1][name], expect[1][name], rtol=1e-4, atol=1e-6,
                                   msg=name)


@pytest.fixture(scope="module")
def plain():
    torch.manual_seed(0)
    return GPT(TINY)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("speedups", [False, True], ids=["plain", "cpu-speedups"])
def test_same_loss_and_gradients_as_without(plain, mode, speedups):
    """Dropout is on: the recomputed forward must draw the masks the first one drew."""
    model = copy.deepcopy(plain)
    changed = apply_activation_checkpointing(model, mode)
    assert changed == (0 if mode == "none" else TINY.n_layer)
    assert all(checkpointing_of(b) == mode for b in model.blocks)
    if speedups:  # oneDNN linears and the chunked loss, swapped in after, as train.py does
        speed_up_training(model, keep_freed_memory=False)
    _assert_same(_loss_and_grads(model), _loss_and_grads(plain))
    assert list(model.state_dict()) == list(plain.state_dict())  # checkpoints interchange
    model.load_state_dict(plain.state_dict())
    with torch.no_grad():  # sampling and evaluation take the plain forward
        prompt = torch.zeros(1, 4, dtype=torch.long)
        torch.testing.assert_close(model.eval()(prompt), copy.deepcopy(plain).eval()(prompt))


def _bytes_kept_for_backward(model) -> int:
    """Bytes of the tensors autograd holds for backward after one forward (each counted once)."""
    kept = {}

    def pack(t):
        kept[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randint(0, TINY.vocab_size, (4, TINY.context_length))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(x, x)
    return sum(n for (ptr, _), n in kept.items() if ptr not in params)


def test_blocks_keep_their_inputs_only(plain):
    """(selective keeps its saves in torch's own cache, out of these hooks' sight: its memory is
    measured by bench/memory.py, whose quick cases tests/train/test_preflight.py runs.)"""
    kept = {}
    for mode in ("none", "blocks"):
        model = copy.deepcopy(plain)
        apply_activation_checkpointing(model, mode)
        kept[mode] = _bytes_kept_for_backward(model)
    assert kept["blocks"] < 0.4 * kept["none"]


@pytest.mark.parametrize("compile, mode", [(True, "selective"), ("blocks", "blocks")])
def test_compiled_same_loss_and_gradients(plain, compile, mode):
    """compile=true (the loss as one graph) and compile=blocks (each block's training call,
    one graph that all blocks reuse), the checkpointed blocks compiled, against the eager
    plain model. Without dropout: compiled code draws its masks from its own generator."""
    torch._dynamo.reset()
    counters.clear()
    eager = copy.deepcopy(plain).eval()
    model = copy.deepcopy(eager)
    apply_activation_checkpointing(model, mode)
    wrapped = ModelWithLoss(model, compile)
    _assert_same(_loss_and_grads(model, wrapped.loss), _loss_and_grads(eager))
    graphs = 1 if compile is True else 2  # blocks: one graph all blocks reuse, and the head's
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    if compile == "blocks":
        assert model.next_token_loss.forward.compiled_for_training
    assert list(model.state_dict()) == list(plain.state_dict())


def test_exact_resume_with_checkpointing_and_across_modes(tmp_path, data_root):  # noqa: F811
    """4 steps with blocks, then 4 more resumed under selective: the losses and weights of 8
    steps without checkpointing (dropout on, so the recomputation must redraw its masks)."""
    common = ["model.dropout=0.1", "optim.decay_steps=8"]
    straight, first, second = LossRecorder(), LossRecorder(), LossRecorder()
    full = run(tiny_cfg(data_root, *common), tmp_path / "full", callbacks=[straight])
    half = run(tiny_cfg(data_root, *common, "trainer.max_steps=4",
                        "trainer.activation_checkpointing=blocks"), tmp_path / "half",
               callbacks=[first])
    resumed = run(tiny_cfg(data_root, *common, "trainer.activation_checkpointing=selective",
                           f"ckpt_path={half['last']}"), tmp_path / "resumed",
                  callbacks=[second])
    expect = [straight.losses[s] for s in range(1, 9)]
    got = [first.losses[s] for s in range(1, 5)] + [second.losses[s] for s in range(5, 9)]
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=0)
    a = torch.load(full["last"], weights_only=True)["model"]
    b = torch.load(resumed["last"], weights_only=True)["model"]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)


def _two_process_run(tmp_path, data_root, name, *args, fsdp=False):  # noqa: F811
    from tests.train.test_run import TINY as TINY_RUN

    script = ROOT / "tests" / "train" / "fsdp_cpu_train.py" if fsdp else ROOT / "train.py"
    run_dir = tmp_path / name
    result = _train_py(tmp_path, *TINY_RUN, f"data_root={data_root}",
                       "trainer=fsdp" if fsdp else "trainer=ddp", "trainer.accelerator=cpu",
                       "trainer.devices=2", "trainer.max_steps=3", "trainer.val_check_interval=3",
                       "sample.max_new_tokens=0", f"hydra.run.dir={run_dir}", *args,
                       timeout=300, script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    sums = _checksums(run_dir)
    assert set(sums) == {"0", "1"} and sums["0"] == sums["1"], sums
    summary = json.loads((run_dir / "summary.json").read_text())
    return float(sums["0"]), summary["val_loss"], result.stdout + result.stderr


def test_ddp_and_fsdp_on_two_gloo_processes_train_as_without(tmp_path, data_root):  # noqa: F811
    """The same 3 steps on 2 CPU processes: DDP without checkpointing (the reference), DDP with
    selective, FSDP (through Fabric, tests/train/fsdp_cpu_train.py) with blocks, each block and
    the head's loss compiled (compile=blocks)."""
    reference = _two_process_run(tmp_path, data_root, "ddp")
    ddp = _two_process_run(tmp_path, data_root, "ddp_selective",
                           "trainer.activation_checkpointing=selective")
    fsdp = _two_process_run(tmp_path, data_root, "fsdp_blocks",  # float32, as the others
                            "trainer.fsdp.activation_checkpointing=true",  # the old key
                            "compile=blocks", fsdp=True)
    assert "activation checkpointing: selective" in ddp[2]
    assert "activation checkpointing: blocks" in fsdp[2] and "CPUFSDPStrategy" in fsdp[2]
    assert "compile: blocks" in fsdp[2]
    for checksum, val_loss, _ in (ddp, fsdp):
        assert checksum == pytest.approx(reference[0], rel=1e-5)
        assert val_loss == pytest.approx(reference[1], rel=1e-5)


def test_config_keys_old_alias_and_errors(tmp_path, data_root):  # noqa: F811
    """trainer.activation_checkpointing reaches the plan; the old FSDP key means blocks and
    contradicting it is one phrase; compile=blocks is a compile mode of its own."""
    from minigpt.config import TrainSchema, train_problems, typed
    from minigpt.train.plan import resolve_plan

    def plan_and_problems(*overrides):
        train = typed(tiny_cfg(data_root, *overrides), TrainSchema)
        return resolve_plan(train), train_problems(train)

    plan, problems = plan_and_problems()
    assert plan.activation_checkpointing == "none" and not problems
    plan, _ = plan_and_problems("trainer.activation_checkpointing=selective", "compile=blocks")
    assert (plan.activation_checkpointing, plan.compile) == ("selective", "blocks")
    plan, problems = plan_and_problems("trainer.fsdp.activation_checkpointing=true")
    assert plan.activation_checkpointing == "blocks" and not problems
    _, problems = plan_and_problems("trainer.fsdp.activation_checkpointing=true",
                                    "trainer.activation_checkpointing=selective")
    assert problems == ["trainer.fsdp.activation_checkpointing=true (the old spelling of "
                        "trainer.activation_checkpointing=blocks) contradicts "
                        "trainer.activation_checkpointing=selective: drop "
                        "trainer.fsdp.activation_checkpointing"]
    result = _train_py(tmp_path, f"data_root={data_root}", "logger=none",
                       "trainer.activation_checkpointing=all")
    assert result.returncode == 2 and result.stderr.strip() == (
        "error: trainer.activation_checkpointing='all' does not fit its type: Invalid value "
        "'all', expected one of [none, blocks, selective]")
