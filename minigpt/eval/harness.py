"""minigpt as a model for lm-evaluation-harness (``lm_eval`` 0.4.x, the ``eval`` extra).

``MiniGPTLM`` answers the harness's requests with minigpt's batched scorer
(``minigpt.eval.scoring``) and KV-cached sampler, on the harness's own tokenization of
context/continuation pairs (``TemplateLM``), so its log-likelihoods are those of the harness's
``hf`` model on the same weights. With a chat template it implements lm-eval's chat hooks
(docs/chat_cli.md). Run it with ``python -m minigpt.eval harness tasks=...`` or ``run_harness``.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable

import torch
from tqdm import tqdm

from minigpt.chat.session import ChatSession
from minigpt.errors import UserError
from minigpt.eval.scoring import score_pairs, score_rows
from minigpt.sampling import generate
from minigpt.tokenizer import EOT_TEXT

INSTALL = "pip install -e '.[eval]' (or: pip install 'lm_eval>=0.4,<0.5' accelerate)"

try:
    # lm-eval loads its built-in models (hf, local-completions...) only into an empty registry:
    # load them before registering ours, so lm_eval.simple_evaluate(model="hf") keeps working.
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # the extra is optional; say how to get it instead of a traceback
    raise UserError(f"lm-evaluation-harness is not installed ({e.name} missing): {INSTALL}") \
        from None


@register_model("minigpt")
class MiniGPTLM(TemplateLM):
    """A minigpt ``GPT`` and its tokenizer as an lm-eval model: give ``model`` and ``tokenizer``,
    or ``ckpt_path``/``pretrained`` (read by ``minigpt.inference.load_for_scoring``, as
    ``python -m minigpt.eval`` reads them). ``batch_size``: rows per forward pass; ``autocast``:
    a function returning each forward pass's context (None: the model's dtype; a loaded model:
    ``dtype``'s); ``max_gen_toks``: a generation's length when a task sets none;
    ``chat_template``: the model's ``ChatTemplate``, for ``apply_chat_template=True``."""

    def __init__(self, model=None, tokenizer=None, *, ckpt_path=None, pretrained=None,
                 batch_size: int = 16, device: str = "cpu", dtype: str = "auto",
                 autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                 max_gen_toks: int = 256, chat_template=None):
        super().__init__()
        if model is None:
            from minigpt.inference import load_for_scoring

            loaded = load_for_scoring(ckpt_path, pretrained, device=device, dtype=dtype)
            model, tokenizer, device = loaded.model, loaded.tokenizer, loaded.device
            autocast = autocast or loaded.scoring_autocast()
            chat_template = chat_template or loaded.chat_template
        elif tokenizer is None:
            raise ValueError("MiniGPTLM needs the model's tokenizer with the model")
        self.model, self.tokenizer_ = model.to(device).eval(), tokenizer
        self.batch_size, self.device_, self.autocast = int(batch_size), device, autocast
        self.max_gen_toks = int(max_gen_toks)
        self.template = chat_template
        self._specials = None if chat_template is None else _special_ids(chat_template)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eot_id

    @property
    def max_length(self) -> int:
        return self.model.config.context_length

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        """The text's ids; with a chat template, its special-token text (as
        ``apply_chat_template`` writes it) as their ids."""
        if self._specials is None:
            return self.tokenizer_.encode(string)
        ids = []
        for i, part in enumerate(self._specials[0].split(string)):  # text, special, text, ...
            ids += [self._specials[1][part]] if i % 2 else self.tokenizer_.encode(part)
        return ids

    # ---- lm-eval's chat hooks ------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        """Names the tokenizer and template in lm-eval's request-cache keys."""
        return f"minigpt-{self.tokenizer_.name}" + ("" if self.template is None else
                                                    f"-{self.template.to_dict()['format']}")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template lm-eval records with the results (JSON of ``ChatTemplate.to_dict``);
        None without one."""
        return None if self.template is None else json.dumps(self.template.to_dict())

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The conversation as text, ending with the assistant's header (or, without
        ``add_generation_prompt``, inside the last assistant message: a prefilled reply)."""
        if self.template is None:
            raise UserError("apply_chat_template needs a chat model: a checkpoint fine-tuned "
                            "with experiment=sft, or chat_template=default")
        history = list(chat_history)
        prefill = None
        if not add_generation_prompt and history and history[-1]["role"] == "assistant":
            prefill = history.pop()["content"]
        text = self.template.decode(self.template.prompt_ids(history))
        return text if prefill is None else text + prefill

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """``(logprob, is_greedy)`` per ``(key, context_ids, continuation_ids)``; requests with
        one context (a multiple-choice question) run it once; a pair too long for the model is
        cut from the left as the harness's ``hf`` model cuts it."""
        with tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood") as bar:
            scores, _ = score_pairs(self.model, [(context, continuation)
                                                 for _, context, continuation in requests],
                                    batch_size=self.batch_size, device=self.device_,
                                    autocast=self.autocast, progress=bar.update)
        return [(s.logprob, s.greedy) for s in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's total log-likelihood, in disjoint windows of the model's context (the
        first conditioned on the end-of-text token), as the harness defines it."""
        rows, owner = [], []
        for i, request in enumerate(requests):
            (text,) = request.args
            windows = get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id,
                                                self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, windows):
                rows.append((context + continuation, len(continuation)))
                owner.append(i)
        with tqdm(total=len(rows), disable=disable_tqdm, desc="loglikelihood", unit="row") as bar:
            scores = score_rows(self.model, rows, batch_size=self.batch_size, device=self.device_,
                                autocast=self.autocast, progress=bar.update)
        totals = [0.0] * len(requests)
        for i, score in zip(owner, scores, strict=True):
            totals[i] += score.logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, if the task asks) continuations, cut at the first stop string."""
        return [self._generate(*request.args)
                for request in tqdm(requests, disable=disable_tqdm, desc="generate_until")]

    def _generate(self, context: str, gen_kwargs: dict) -> str:
        """One continuation (with a chat template, the greedy reply to its end token, through
        ``minigpt.chat.session``), cut at the first stop string; a context longer than the
        model's keeps its last tokens."""
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        ids = self.tok_encode(context)[-max(1, self.max_length - max_new):]
        if self.template is not None:
            text = ChatSession(self.model, self.tokenizer_, self.template, max_new_tokens=max_new,
                               autocast=self.autocast).complete(ids).text
        else:
            temperature = float(kwargs.pop("temperature", 0.0))
            if not kwargs.pop("do_sample", temperature > 0):  # as the harness's hf model reads them
                temperature = 0.0  # greedy
            ids = ids or [self.eot_token_id]
            with self.autocast() if self.autocast is not None else contextlib.nullcontext():
                out = generate(self.model, torch.tensor([ids], device=self.device_), max_new,
                               temperature=temperature, eos_id=self.eot_token_id,
                               vocab_size=self.tokenizer_.vocab_size)
            new = out[0, len(ids):].tolist()
            text = self.tokenizer_.decode(new[:new.index(self.eot_token_id)]
                                          if self.eot_token_id in new else new)
            eot_text = self.tokenizer_.decode([self.eot_token_id])
            until += [eot_text] if eot_text not in until else []
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return text


def _special_ids(template) -> tuple[re.Pattern, dict[str, int]]:
    """A pattern that splits text at the template's special-token text (kept, as the odd
    parts), and each one's id; end-of-text is the template's BOS."""
    ids = {**template.special_ids, EOT_TEXT: template.bos_id}
    return re.compile("(" + "|".join(map(re.escape, ids)) + ")"), ids


def run_harness(lm: MiniGPTLM, tasks: list[str], *, num_fewshot: int | None = None,
                limit: int | None = None, include_path=None, task_manager=None,
                apply_chat_template: bool = False) -> dict:
    """``lm_eval.simple_evaluate`` on ``lm`` for ``tasks`` (names, or tasks in YAML files under
    ``include_path``; or those of a ready ``task_manager``); its results dict, without
    per-sample logs. ``apply_chat_template``: each prompt as a conversation in ``lm``'s chat
    template (few-shot examples as earlier turns)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = task_manager or TaskManager(
        include_path=str(include_path) if include_path is not None else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"lm_eval knows no task {', '.join(map(repr, unknown))}; `lm_eval ls "
                        "tasks` lists them (a task of your own: include_path=DIR of task YAMLs)")
    return simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                           task_manager=manager, log_samples=False,
                           apply_chat_template=apply_chat_template)
