"""The OpenAI Python client against `kvconnect serve` and against `kvconnect router` in front."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.serving import RouterProcess, Serve, get, post

pytestmark = pytest.mark.slow

GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def served(tiny_api: tuple[Serve, RouterProcess]) -> tuple[Serve, RouterProcess]:
    return tiny_api  # tests/serve/conftest.py (module scope keeps the module on one worker)


@pytest.fixture(params=["serve", "router"])
def client(request: pytest.FixtureRequest, served: tuple[Serve, RouterProcess]) -> openai.OpenAI:
    target = served[0] if request.param == "serve" else served[1]
    return openai.OpenAI(base_url=target.url + "/v1", api_key="unused", max_retries=0)


def test_ready_line_names_every_address(served: tuple[Serve, RouterProcess]) -> None:
    server, router = served
    p = server.port
    assert server.ready_line == (
        f"kvconnect serve: ready at http://127.0.0.1:{p} (model tiny); KV events "
        f"tcp://127.0.0.1:{p + 10000}, replay tcp://127.0.0.1:{p + 20000}"
    )
    assert router.ready_line.startswith(f"kvconnect router: ready at {router.url}; instances:")
    assert f"events tcp://127.0.0.1:{p + 10000}" in router.ready_line


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completions_every_prompt_shape_and_n(client: openai.OpenAI) -> None:
    one = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, **GREEDY)
    assert len(one.choices) == 1 and one.choices[0].finish_reason == "length"
    assert one.usage is not None and (one.usage.prompt_tokens, one.usage.completion_tokens) == (
        5,
        5,
    )
    many = client.completions.create(
        model="tiny", prompt=["Hello", "World!"], n=2, max_tokens=4, **GREEDY
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert (
        many.choices[0].text
        == many.choices[1].text
        == one.choices[0].text[: len(many.choices[0].text)]
    )
    assert many.usage is not None and many.usage.prompt_tokens == 5 + 6  # once per prompt
    assert many.usage.completion_tokens == 16
    ids = client.completions.create(model="tiny", prompt=[72, 101, 108], max_tokens=3, **GREEDY)
    lists = client.completions.create(
        model="tiny", prompt=[[72, 101, 108], [72]], max_tokens=3, **GREEDY
    )
    assert lists.choices[0].text == ids.choices[0].text and len(lists.choices) == 2


def test_stop_strings_and_stop_tokens_end_the_output_without_them(client: openai.OpenAI) -> None:
    base = client.completions.create(model="tiny", prompt="stop test", max_tokens=12, **GREEDY)
    text = base.choices[0].text
    stop = text[5:7]
    cut = text.index(stop)
    stopped = client.completions.create(
        model="tiny", prompt="stop test", max_tokens=12, stop=[stop], **GREEDY
    )
    assert stopped.choices[0].text == text[:cut]
    assert stopped.choices[0].finish_reason == "stop"
    ids = client.completions.create(
        model="tiny",
        prompt="stop test",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ).choices[0]
    assert ids.prompt_token_ids == list(b"stop test")  # type: ignore[attr-defined]
    generated = ids.token_ids  # type: ignore[attr-defined]
    assert len(generated) == 12
    stop_id = generated[3]
    by_token = client.completions.create(
        model="tiny",
        prompt="stop test",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id], "return_token_ids": True},
    ).choices[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == stop_id  # type: ignore[attr-defined]
    assert by_token.token_ids == generated[: generated.index(stop_id) + 1]  # type: ignore[attr-defined]


def test_streaming_gives_the_same_text_and_usage_last(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny", prompt="stream me", max_tokens=8, **GREEDY)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="stream me",
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])


def test_chat_and_streamed_chat(client: openai.OpenAI) -> None:
    messages: Any = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say something."},
    ]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, **GREEDY)
    content = reply.choices[0].message.content
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert content and reply.usage is not None and reply.usage.completion_tokens == 6
    stream = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, stream=True, **GREEDY
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == content


def test_cached_tokens_are_reported_in_usage(client: openai.OpenAI) -> None:
    prompt = "A long shared prefix for the cache. " * 8
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage is not None and again.usage is not None
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == (len(prompt) - 1) // 16 * 16


def test_errors_are_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"  # type: ignore[index]
    max_model_len = client.models.list().data[0].max_model_len  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny", prompt="x" * max_model_len, max_tokens=4)
    assert "context" in long.value.message and long.value.body["param"] == "prompt"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as streamed:  # a 400, not a stream that fails
        client.completions.create(
            model="tiny", prompt="x" * max_model_len, max_tokens=4, stream=True
        )
    assert "context" in streamed.value.message


def test_a_wrong_model_is_a_404(served: tuple[Serve, RouterProcess]) -> None:
    server, _ = served
    status, body, _ = post(server.url + "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert body["error"]["param"] == "model"


def test_a_body_over_the_limit_is_a_413(served: tuple[Serve, RouterProcess]) -> None:
    for target in served:
        status, body, _ = post(target.url + "/v1/completions", b" " * (5 << 20))
        assert status == 413 and "limit" in body["error"]["message"]


def test_metrics_have_help_type_and_vllms_names(served: tuple[Serve, RouterProcess]) -> None:
    server, router = served
    status, text = get(server.url + "/metrics")
    assert status == 200
    for name in (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:num_requests_running",
        "kvconnect_kv_events_total",
    ):
        assert f"{name}{{" in text or f"{name} " in text, name
    assert "# HELP vllm:prefix_cache_hits_total" in text
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert 'model_name="tiny"' in text
    status, text = get(router.url + "/metrics")
    assert status == 200 and "# TYPE kvconnect_router_decisions_total counter" in text
    assert f'kvconnect_router_instance_up{{instance="{server.url}"}} 1.0' in text


def test_health(served: tuple[Serve, RouterProcess]) -> None:
    server, router = served
    assert get(server.url + "/health") == (200, {"status": "ok"})
    status, body = get(router.url + "/health")
    assert status == 200 and body["instances"][server.url]["state"] == "up"


def test_unknown_paths_are_404_not_5xx(served: tuple[Serve, RouterProcess]) -> None:
    for target in served:
        assert get(target.url + "/v1/embeddings")[0] == 404


def raw_post(target: Serve | RouterProcess, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request written by hand (headers a client library would not send); status, body."""
    import socket

    with socket.create_connection(("127.0.0.1", target.port), timeout=10) as sock:
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        status = int(data.split(b" ", 2)[1])
        return status, data.split(b"\r\n\r\n", 1)[1]


def test_a_subnormal_temperature_is_greedy_and_harms_nothing(client: openai.OpenAI) -> None:
    greedy = client.completions.create(model="tiny", prompt="Hi", max_tokens=6, **GREEDY)
    tiny = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=6, temperature=1e-320, extra_body={"ignore_eos": True}
    )
    assert tiny.choices[0].text == greedy.choices[0].text
    assert client.models.list().data  # the instance is alive


def test_compressed_bodies_that_do_not_decode_are_400s(served: tuple[Serve, RouterProcess]) -> None:
    for target in served:
        for encoding in (b"gzip", b"deflate"):
            body = b"\x1f\x8b not really compressed"
            head = (
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Encoding: " + encoding + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
            )
            status, answer = raw_post(target, head, body)
            assert status == 400 and b"does not decode" in answer, (target.url, answer)


def test_a_declared_length_over_the_limit_is_a_413_before_any_body(
    served: tuple[Serve, RouterProcess],
) -> None:
    for target in served:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        status, answer = raw_post(target, head)  # no body sent: the answer comes anyway
        assert status == 413 and b"limit" in answer


def test_an_empty_cache_salt_is_refused(served: tuple[Serve, RouterProcess]) -> None:
    for target in served:
        status, body, _ = post(target.url + "/v1/completions", {"prompt": "x", "cache_salt": ""})
        assert status == 400 and body["error"]["param"] == "cache_salt", body
