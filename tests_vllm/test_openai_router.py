"""The OpenAI Python client through `kvconnect router` to real `vllm serve` instances: models,
chat (rendered by the router with the model's own chat template, so chats get prefix hits),
streaming, and the router's view of each instance's health."""

from __future__ import annotations

import openai

from tests_vllm.conftest import RouterProcess, VllmServer, get_json, post_json
from tests_vllm.test_serve import long_prompt, wait_until

SYSTEM = "You are a terse assistant. Context follows. " + long_prompt(99, words=300)


def client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def test_models_come_from_vllm_through_the_router(router: RouterProcess) -> None:
    assert [m.id for m in client(router).models.list().data] == ["smollm2"]


def test_a_repeated_chat_goes_back_to_its_instance_with_a_prefix_hit(
    router: RouterProcess, vllm_servers: list[VllmServer]
) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    first = client(router).chat.completions.with_raw_response.create(
        model="smollm2",
        messages=messages,
        max_tokens=4,
        temperature=0,  # type: ignore[arg-type]
    )
    where = first.headers["x-kvconnect-instance"]
    owner = next(s for s in vllm_servers if s.url == where)

    def held() -> int:
        answer, _ = post_json(router.url + "/kv/score", {"messages": messages})
        return int(answer["instances"][where]["cached_tokens"])

    # The router's rendering of the chat hashes to the blocks vLLM stored for its rendering.
    wait_until(lambda: held() >= 4 * owner.block_size, f"{where} holds the chat's prefix")
    follow_up = [*messages[:1], {"role": "user", "content": "And goodbye?"}]
    again = client(router).chat.completions.with_raw_response.create(
        model="smollm2",
        messages=follow_up,
        max_tokens=4,
        temperature=0,  # type: ignore[arg-type]
    )
    assert again.headers["x-kvconnect-instance"] == where
    usage = again.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) >= 4 * owner.block_size


def test_streamed_chat_through_the_router(router: RouterProcess) -> None:
    chunks = list(
        client(router).chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12,
            temperature=0,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_router_health_lists_each_vllm_instance_up(
    router: RouterProcess, vllm_servers: list[VllmServer]
) -> None:
    health = get_json(router.url + "/health")
    assert health["status"] == "ok"
    assert {name: s["state"] for name, s in health["instances"].items()} == {
        s.url: "up" for s in vllm_servers
    }
