"""Two real `vllm serve` instances (SmolLM2-135M, KV events on, block sizes 32 and 64) behind
`kvconnect router` at its defaults: repeated prompts go back to the instance that cached them."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable

from tests_vllm.conftest import RouterProcess, VllmServer, post_json

WORDS = [
    "river",
    "stone",
    "cloud",
    "amber",
    "lantern",
    "meadow",
    "quartz",
    "violet",
    "harbor",
    "ember",
    "willow",
]


def long_prompt(seed: int, words: int = 700) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def complete(url: str, prompt: str) -> tuple[dict[str, object], str]:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    answer, headers = post_json(url + "/v1/completions", body)
    return answer, headers.get("x-kvconnect-instance", "")


def cached_tokens(answer: dict[str, object]) -> int:
    usage = answer["usage"]
    assert isinstance(usage, dict)
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s: {what}"
        time.sleep(0.2)


def held(router: RouterProcess, server: VllmServer, prompt: str) -> int:
    """Tokens of `prompt` the router's index says `server` holds."""
    answer, _ = post_json(router.url + "/kv/score", {"prompt": prompt})
    return int(answer["instances"][server.url]["cached_tokens"])


def learned(router: RouterProcess, server: VllmServer) -> bool:
    """The router has seen a prefix-starting event of `server` and knows how it hashes."""
    want = {
        "instance": server.url,
        "scheme": "sha256:vllm-none-hash",
        "block_size": str(server.block_size),
    }
    for labels, value in re.findall(
        r"^kvconnect_router_instance_hash_scheme\{(.*)\} (\S+)$", router.metrics(), re.M
    ):
        if dict(re.findall(r'(\w+)="([^"]*)"', labels)) == want and float(value) == 1:
            return True
    return False


def decisions(router: RouterProcess, server: VllmServer) -> int:
    found = re.search(
        rf'kvconnect_router_decisions_total\{{instance="{re.escape(server.url)}"\}} (\d+)',
        router.metrics(),
    )
    return int(found.group(1)) if found else 0


def test_a_repeated_prompt_goes_back_to_the_vllm_instance_that_cached_it(
    router: RouterProcess, vllm_servers: list[VllmServer]
) -> None:
    prompt = long_prompt(1)
    first, where = complete(router.url, prompt)
    owner = next(s for s in vllm_servers if s.url == where)
    wait_until(lambda: held(router, owner, prompt) > 0, f"{owner.url}'s events reach the router")
    assert learned(router, owner)
    for _ in range(3):
        again, where_again = complete(router.url, prompt)
        assert where_again == owner.url
        # vLLM itself reports the prefix it found in its cache: whole blocks of its size.
        usage = first["usage"]
        assert isinstance(usage, dict)
        whole_blocks = (int(usage["prompt_tokens"]) - 1) // owner.block_size
        assert cached_tokens(again) == whole_blocks * owner.block_size


def test_each_instance_is_matched_at_its_own_block_size(
    router: RouterProcess, vllm_servers: list[VllmServer]
) -> None:
    """Warm each server directly with its own prompt; the router must then send each prompt
    to the server that holds it, though they cut prompts into different block sizes."""
    prompts = {s.url: long_prompt(10 + i) for i, s in enumerate(vllm_servers)}
    for s in vllm_servers:
        complete(s.url, prompts[s.url])
    for s in vllm_servers:
        wait_until(
            lambda s=s: held(router, s, prompts[s.url]) >= 4 * s.block_size,  # type: ignore[misc]
            f"{s.url} holds its prompt",
        )
        assert learned(router, s)
    for s in vllm_servers:
        before = decisions(router, s)
        answer, where = complete(router.url, prompts[s.url])
        assert where == s.url and cached_tokens(answer) >= 4 * s.block_size
        assert decisions(router, s) == before + 1
