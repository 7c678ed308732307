"""lm-eval's ``local-completions`` model against the live server (tokenizing through its
/tokenize, as ``tokenizer_backend=remote`` does): each item's log-likelihood equals the
in-process harness adapter's (``python -m minigpt.eval harness``, minigpt.eval.harness) on the
same weights."""

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402

from minigpt.eval.harness import MiniGPTLM  # noqa: E402

PAIRS = [("the cat sat on the", " mat"), ("1+1=", "2"), ("hello", " world, again"),
         ("a", "b"), ("why? because", " it is.")]


def requests():
    return [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
            for i, pair in enumerate(PAIRS)]


def test_local_completions_loglikelihoods_equal_the_harness_adapter(base_checkpoint,
                                                                    base_server_url):
    served = LocalCompletionsAPI(base_url=f"{base_server_url}/v1/completions", model="m",
                                 tokenizer_backend="remote", tokenized_requests=True,
                                 max_length=64, num_concurrent=2, max_retries=1)
    in_process = MiniGPTLM(ckpt_path=str(base_checkpoint), device="cpu", dtype="float32")
    got = served.loglikelihood(requests())
    expected = in_process.loglikelihood(requests())
    for (logprob, greedy), (want, want_greedy) in zip(got, expected, strict=True):
        assert logprob == pytest.approx(want, abs=1e-4)
        assert greedy == want_greedy
