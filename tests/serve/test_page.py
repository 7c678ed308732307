"""The chat page at / in a real headless browser (Debian's chromium driven by Playwright): a typed
message gets a reply streamed into the page piece by piece, equal to the server's own
non-streamed greedy answer, with the context use it reports; reset clears the conversation; a
base model's refusal shows the server's message and gives the typed text back.

The network is throttled (Chrome DevTools' network emulation) so the stream arrives in many reads
and the page's growing text can be watched; the page itself is unchanged. Skips, saying why, where
Playwright or a chromium cannot be had (``.ci/run`` installs Debian's).
"""

from __future__ import annotations

import shutil

import httpx
import pytest

CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium; .ci/run does)")
    with sync_api.sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        except Exception as error:  # a chromium that cannot start here: say why, once
            pytest.skip(f"chromium at {executable} does not start: {str(error).splitlines()[0]}")
        yield browser
        browser.close()


def _open(browser, url: str, throttle: bool = False):
    """The page at ``url``, once it has asked the server for its model."""
    page = browser.new_page()
    page.set_default_timeout(20_000)
    page.goto(url)
    page.wait_for_function("document.getElementById('model-name').textContent !== 'loading…'")
    if throttle:  # a few hundred bytes a read: the stream's events arrive a few at a time
        cdp = page.context.new_cdp_session(page)
        cdp.send("Network.enable")
        cdp.send("Network.emulateNetworkConditions", {
            "offline": False, "latency": 0, "downloadThroughput": 4000,
            "uploadThroughput": -1})
    return page


def _greedy_settings(page, max_tokens: int) -> None:
    page.click("#settings summary")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(max_tokens))


def _watch_reply(page) -> None:
    """Record, in the page, the reply's text and the send button's state at every change."""
    page.evaluate("""() => {
        window.seen = [];
        const send = document.getElementById('send');
        new MutationObserver(() => {
            const reply = document.querySelector('li.assistant .content');
            if (reply) window.seen.push([reply.textContent, send.disabled]);
        }).observe(document.getElementById('conversation'),
                   {childList: true, subtree: true, characterData: true});
    }""")


def _greedy_answer(url: str, messages: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
    response = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": messages, "temperature": 0, "max_tokens": max_tokens}, timeout=60)
    response.raise_for_status()
    return response.json()


def test_a_reply_streams_in_and_reset_clears_it(browser, server_url):
    model = httpx.get(f"{server_url}/v1/models").json()["data"][0]
    page = _open(browser, server_url + "/", throttle=True)
    assert page.text_content("#model-name") == model["id"]
    assert page.text_content("#context-text") == f"0 / {model['context_length']} tokens"
    _greedy_settings(page, MAX_TOKENS)
    _watch_reply(page)

    page.fill("#message", "hello there")
    page.press("#message", "Enter")
    page.wait_for_function("!document.getElementById('send').disabled", timeout=60_000)

    expected = _greedy_answer(server_url, [{"role": "user", "content": "hello there"}])
    reply = expected["choices"][0]["message"]["content"]
    assert page.text_content("li.user .content") == "hello there"
    assert page.text_content("li.assistant .content") == reply
    seen = page.evaluate("window.seen")
    texts = [text for text, _ in seen if text]
    assert len(set(texts)) >= 3, f"the reply did not grow piece by piece: {texts}"
    assert all(reply.startswith(text) for text in texts)
    assert all(disabled for text, disabled in seen if text != reply), "send was enabled mid-reply"
    total = expected["usage"]["total_tokens"]
    assert page.text_content("#context-text") == f"{total} / {model['context_length']} tokens"
    assert page.is_hidden("#error")

    page.click("#reset")
    assert page.locator("#conversation li").count() == 0
    assert page.text_content("#context-text") == f"0 / {model['context_length']} tokens"
    page.close()


def test_a_base_model_refusal_is_shown_and_the_message_kept(browser, base_server_url):
    refusal = httpx.post(f"{base_server_url}/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "hi"}]})
    assert refusal.status_code == 400
    page = _open(browser, base_server_url + "/")
    assert page.is_visible("#model-note")
    page.fill("#message", "hi")
    page.click("#send")
    page.wait_for_selector("#error", state="visible")
    assert page.text_content("#error") == f"Error 400: {refusal.json()['error']['message']}"
    assert page.input_value("#message") == "hi"
    assert page.locator("#conversation li").count() == 0
    page.close()


def test_stop_keeps_the_reply_so_far(browser, server_url):
    page = _open(browser, server_url + "/", throttle=True)
    _greedy_settings(page, 80)
    page.fill("#message", "tell me more")
    page.click("#send")
    page.wait_for_function(
        "(document.querySelector('li.assistant .content')?.textContent.length ?? 0) >= 3")
    page.click("#stop")
    page.wait_for_selector("li.assistant .note")
    assert page.text_content("li.assistant .note") == "(stopped)"
    assert page.is_enabled("#send") and page.is_disabled("#stop")
    partial = page.text_content("li.assistant .content")
    full = _greedy_answer(server_url, [{"role": "user", "content": "tell me more"}], 80)
    assert 3 <= len(partial) < len(full["choices"][0]["message"]["content"])
    assert full["choices"][0]["message"]["content"].startswith(partial)
    page.close()


def test_the_api_key_is_asked_for_and_remembered(browser, start_server, chat_checkpoint):
    url = start_server(chat_checkpoint, api_key="open sesame").url
    name = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer open sesame"}
                     ).json()["data"][0]["id"]
    named = f"document.getElementById('model-name').textContent === {name!r}"
    page = _open(browser, url + "/")
    assert page.text_content("#model-name") == "unknown"
    assert page.text_content("#error").startswith("The server needs an API key (401)")
    assert page.evaluate("document.getElementById('settings').open")
    page.fill("#api-key", "open sesame")
    page.press("#api-key", "Enter")  # a change event: the key is stored and the model asked for
    page.wait_for_function(named)
    assert page.is_hidden("#error")
    page.reload()
    page.wait_for_function(named)
    assert page.input_value("#api-key") == "open sesame"
    page.close()


def test_a_full_queue_says_when_to_retry(browser, server_url):
    """The server's 429 (its queue full) as it sends it; routed here, since filling the queue
    for real depends on timing."""
    page = _open(browser, server_url + "/")
    busy = {"error": {"message": "the server is busy: 64 requests are waiting (max_queue=64); "
                                 "retry shortly", "type": "rate_limit_error", "param": None,
                      "code": "queue_full"}}
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=429, headers={"Retry-After": "1"}, json=busy))
    page.fill("#message", "hello")
    page.click("#send")
    page.wait_for_selector("#error", state="visible")
    assert page.text_content("#error") == (f"The server is busy (429): "
                                           f"{busy['error']['message']}. Retry in 1 s.")
    assert page.input_value("#message") == "hello" and page.is_enabled("#send")
    page.close()
