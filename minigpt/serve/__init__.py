"""``python -m minigpt.serve ckpt_path=...``: one model over HTTP, in the OpenAI protocol, with
continuous batching over the model's own KV cache and a chat page at ``/``.

Contract (what the page, the tests and the benchmark build on):

- ``minigpt.serve.server.load_service(ServeSchema(...)) -> Service``: the model loaded by
  ``minigpt.inference.load_for_inference`` (generate.py's device and dtype rules), its engine
  not yet started; ``minigpt.serve.app.create_app(service, api_key=None, max_body_bytes=...)
  -> FastAPI``; ``minigpt.serve.server.serve_in_thread(service, api_key=None) -> ThreadedServer``
  (a context manager: starts the engine and uvicorn on a free loopback port; ``.url`` is
  ``http://127.0.0.1:PORT``). tests/serve/conftest.py has the fixtures: ``chat_checkpoint``,
  ``base_checkpoint`` (tiny models with and without a chat template), ``server_url`` (the chat
  model served), ``base_server_url``, ``start_server``.
- ``GET /`` serves ``static/index.html``. ``GET /v1/models`` -> ``{"object": "list", "data":
  [{"id", "object": "model", "context_length", "chat"}]}`` (``chat``: a chat template is
  stored). ``POST /v1/chat/completions`` with ``stream: true`` sends ``chat.completion.chunk``
  events (``choices[0].delta.content``), and with ``stream_options: {"include_usage": true}``
  a last chunk ``{"choices": [], "usage": {prompt_tokens, completion_tokens, total_tokens}}``
  before ``data: [DONE]``. Errors: ``{"error": {"message", "type", "param", "code"}}``.
- With ``api_key`` set, every route but ``/`` and ``/health`` needs ``Authorization: Bearer
  <key>``.

Modules: ``config`` (the schema), ``protocol`` (request bodies, errors), ``service`` (requests
-> sequences), ``sequence`` (one decoded sequence), ``batch`` (the running rows' KV cache),
``engine`` (the decode thread), ``streams`` (responses and chunks), ``app`` (routes), ``server``
(loading and uvicorn).
"""
