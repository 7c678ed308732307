"""Held-out conversations as an evaluation task (``task=chat path=val.jsonl``), scored through
a chat model's own template (docs/chat_cli.md): ``exact_match`` of the greedy reply against an
item's last (assistant) message, outer whitespace aside; ``mc_acc`` of the likeliest of an item's
``"choices"`` against its ``"answer"`` index. Each is the mean over the items that have it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from minigpt.chat.cli import exact_match, read_records, split_reference
from minigpt.chat.session import ChatSession, ContextFullError
from minigpt.chat.template import ChatFormatError
from minigpt.errors import UserError
from minigpt.eval.scoring import Score
from minigpt.eval.task import Task
from minigpt.sampling import evaluating

FORMAT = ('a chat item is {"messages": [...]} ending with the assistant\'s reference reply, or '
          'with "choices": [text, ...] and "answer": <index>')
SLACK_TOKENS = 8  # a reply may run this far past its reference's length (whitespace) and match


class ChatTask(Task):
    """Exact match and multiple choice on held-out conversations (see the module docstring)."""

    name = "chat"
    metrics = ("exact_match", "mc_acc")
    uses_chat_template = True

    def items(self, limit: int | None = None) -> list[dict]:
        if self.path is None:
            raise UserError("task=chat needs path=FILE.jsonl of held-out conversations; "
                            f"{FORMAT}")
        return read_records(self.path, limit, check=_check_item)

    def requests(self, item: dict, tokenizer) -> list[tuple[list[int], list[int]]]:
        if "choices" not in item:
            return []
        template = self._template()
        context = template.prompt_ids(item["messages"])
        return [(context, tokenizer.encode(choice) + [template.end_id])
                for choice in item["choices"]]

    def replies(self, model, items: Sequence[dict], *, device="cpu",
                autocast: Callable[[], contextlib.AbstractContextManager] | None = None
                ) -> list[str | None]:
        """The greedy reply to each exact-match item; None for the others and for an item too
        long for the context (a miss)."""
        template = self._template()
        session = ChatSession(model, template.tokenizer, template, temperature=0,
                              autocast=autocast)
        replies = []
        with evaluating(model):
            for item in items:
                prompt, reference = split_reference(item["messages"])
                if "choices" in item:
                    replies.append(None)
                    continue
                # a reply longer than the reference (and some whitespace) cannot match it
                session.max_new_tokens = len(template.tokenizer.encode(reference)) + SLACK_TOKENS
                try:
                    replies.append(session.answer(prompt).text)
                except ContextFullError:
                    replies.append(None)
        return replies

    def item_metrics(self, item: dict, scores: Sequence[Score], reply=None) -> dict:
        if "choices" in item:
            best = max(range(len(scores)), key=lambda i: scores[i].logprob)
            return {"mc_acc": float(best == item["answer"]), "choice": best}
        reference = item["messages"][-1]["content"]
        return {"exact_match": float(reply is not None and exact_match(reply, reference)),
                "reply": reply}

    def summary(self, per_item: list[dict]) -> dict:
        """Each item's reply (exact match) or choice (multiple choice), in item order."""
        return {"answers": [r.get("reply", r.get("choice")) for r in per_item]}

    def _template(self):
        if self.chat_template is None:
            raise UserError("task=chat scores a chat model through its chat template: give a "
                            "checkpoint fine-tuned with experiment=sft, or chat_template=default")
        return self.chat_template


def _check_item(record: dict) -> None:
    """An item is one of the two kinds; anything else is one line naming the field."""
    messages = record["messages"]
    if "choices" not in record and "answer" not in record:
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            raise ChatFormatError(f"no reference: end 'messages' with the assistant's "
                                  f"reply after the prompt; {FORMAT}")
        return
    choices, answer = record.get("choices"), record.get("answer")
    if not isinstance(choices, list) or len(choices) < 2 \
            or not all(isinstance(c, str) and c for c in choices):
        raise ChatFormatError(f"field 'choices' must list at least two non-empty "
                              f"texts; {FORMAT}")
    if isinstance(answer, bool) or not isinstance(answer, int) \
            or not 0 <= answer < len(choices):
        raise ChatFormatError(f"field 'answer'={answer!r} must be the index of the "
                              f"right choice, 0 to {len(choices) - 1}")
    if messages[-1]["role"] == "assistant":
        raise ChatFormatError("a multiple-choice item ends with the question, not an "
                              "assistant message: the choices are the replies")
