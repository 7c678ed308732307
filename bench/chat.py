"""Chat decoding keeps its KV cache across turns: turn N's time should not grow with the history.

    python -m bench.chat --threads 1            # 12 turns, 6 layers x 384 dims, a few minutes
    python -m bench.chat --turns 16 --user-tokens 48 --reply-tokens 8   # the history dominates

One conversation of ``--turns`` user messages (``--user-tokens`` GPT-2 tokens each), every reply
exactly ``--reply-tokens`` tokens (greedy, the end token masked out so every turn does the same
work), two ways, turn by turn interleaved so machine noise hits both alike:

- "kept cache": ``ChatSession.say``, what ``generate.py chat=true`` runs: each turn reads only
  the new user message and the assistant header, then decodes the reply;
- "re-read": ``ChatSession.complete`` on the whole conversation so far (the same tokens): the
  history is read again (one prefill pass) before the reply is decoded, as a chat loop without a
  kept cache does.

The replies should be the same (the count of turns where they are is printed: a near-tie of
two logits may flip between one long pass and many short ones). The table has the median ms of each turn over
``--repeats`` conversations, the history the turn starts from, and re-read / kept per turn; the
last line compares the last turn's time with the first's for each way. Random weights (a model
of ``--layers`` x ``--embd``, GPT-2's vocabulary), float32, the plain ``nn.Linear`` model, on
the CPU or ``--device cuda`` (every token is read back to the host, so the clock needs no
extra synchronization).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.timing import add_timing_arguments, clock, configure_timing, print_header
from minigpt.chat.session import ChatSession
from minigpt.chat.template import ChatTemplate
from minigpt.model import GPT, GPTConfig
from minigpt.tokenizer import get_tokenizer

WORDS = ("the model reads every new message once and keeps what it has read in its cache so "
         "that a long conversation costs no more per turn than a short one ").split()


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    configure_timing(parser, args)
    torch.manual_seed(0)
    tokenizer = get_tokenizer("gpt2")
    model = GPT(GPTConfig(vocab_size=50304, context_length=args.context, n_layer=args.layers,
                          n_head=args.embd // 64, n_embd=args.embd)).eval().to(args.device)
    template = ChatTemplate.for_tokenizer(tokenizer)
    kept, reread = (_session(model, tokenizer, template, args.reply_tokens) for _ in range(2))
    users = [_user_message(tokenizer, n, args.user_tokens) for n in range(args.turns)]
    kept_ms = [[] for _ in users]
    reread_ms = [[] for _ in users]
    before = [0] * len(users)  # tokens of the conversation before each turn
    for _ in range(args.warmup + args.repeats):
        kept.reset()
        equal = 0
        ids = [template.bos_id]  # the conversation's tokens, the replies as sampled
        for n, text in enumerate(users):
            message = {"role": "user", "content": text}
            before[n] = len(ids)
            ids += template.message_ids(message) + [template.assistant_id]
            start = clock()
            reply = kept.say(text)
            middle = clock()
            again = reread.complete(ids)
            end = clock()
            equal += reply.ids == again.ids
            kept_ms[n].append(1e3 * (middle - start))
            reread_ms[n].append(1e3 * (end - middle))
            ids += reply.ids + [template.end_id]
    _report(args, before, kept_ms, reread_ms, equal)


def _session(model, tokenizer, template, reply_tokens: int) -> ChatSession:
    session = ChatSession(model, tokenizer, template, max_new_tokens=reply_tokens,
                          temperature=0)
    session.allowed[template.end_id] = float("-inf")  # every reply runs to its full length
    return session


def _user_message(tokenizer, n: int, tokens: int) -> str:
    """A message of about ``tokens`` GPT-2 tokens, different for every turn."""
    words = [WORDS[(n * 7 + i) % len(WORDS)] for i in range(tokens)]
    return tokenizer.decode(tokenizer.encode(" ".join(words))[:tokens])


def _report(args, before, kept_ms, reread_ms, equal: int) -> None:
    skip = args.warmup
    kept = [statistics.median(t[skip:]) for t in kept_ms]
    reread = [statistics.median(t[skip:]) for t in reread_ms]
    print(f"{args.layers} layers x {args.embd} dims on {args.device}, {args.turns} turns of "
          f"{args.user_tokens} user + {args.reply_tokens} reply tokens, {args.threads} "
          f"thread(s), median of {args.repeats}")
    print_header(f"{'turn':>4} {'history':>8} {'kept ms':>9} {'re-read ms':>11} {'ratio':>6}")
    for n in range(args.turns):
        print(f"{n + 1:>4} {before[n]:>8} {kept[n]:>9.1f} {reread[n]:>11.1f} "
              f"{reread[n] / kept[n]:>6.2f}")
    print(f"turn {args.turns} / turn 1: kept cache {kept[-1] / kept[0]:.2f}x, re-read "
          f"{reread[-1] / reread[0]:.2f}x; equal replies in {equal} of {args.turns} turns "
          "(last conversation)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--user-tokens", type=int, default=24)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--embd", type=int, default=384)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (float32 weights)")
    add_timing_arguments(parser, warmup=1, repeats=3)
    return parser


if __name__ == "__main__":
    main()
