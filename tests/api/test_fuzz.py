"""Careless and hostile clients against `kvconnect serve` and `kvconnect router` (real processes).

Thousands of malformed requests, from a fixed seed: every field of both request kinds with
values of the wrong type, out of range, huge, negative, NaN; bodies that are not UTF-8, not
JSON, truncated, nested a million deep or over the size limit; wrong methods, paths and content
types; clients that stall half-way; and concurrent floods of all of it. What must hold:

    no response is a 5xx      (every one is a 4xx naming the problem, or a 200 if it was valid)
    no request hangs          (every one answers within its timeout)
    no process dies           (both are alive and healthy at the end)
    a valid request succeeds  after every 100 malformed ones
"""

from __future__ import annotations

import http.client
import json
import random
import socket
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import pytest

from tests.serving import RouterProcess, Serve, get

pytestmark = [pytest.mark.slow, pytest.mark.solo]  # every request answers within its deadline

TIMEOUT_S = 60.0

# Raw JSON texts (not Python values): some (1e400, NaN) have no Python equivalent to dump.
BAD_VALUES = [
    "null",
    "true",
    "false",
    '"4"',
    '""',
    "4.5",
    "-1",
    "0",
    "-0.0",
    "1e400",
    "-1e400",
    "NaN",
    "Infinity",
    "9" * 40,
    "-" + "9" * 40,
    str(2**63),
    str(2**64),
    "[]",
    "{}",
    "[1.5, 2]",
    "[true]",
    '["a", 1]',
    "[[1, 2]]",
    "[[]]",
    "[null]",
    "[-1]",
    "[99999999]",
    '{"a": 1}',
    '"' + "x" * 20_000 + '"',
    "[" + ",".join(["7"] * 5000) + "]",
    '"\\u0000"',
    '"\\ud800"',
]

COMPLETION_FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "stop_token_ids",
    "seed",
    "stream",
    "stream_options",
    "ignore_eos",
    "cache_salt",
    "return_token_ids",
    "user",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "bad_words",
    "prompt_logprobs",
    "echo",
    "best_of",
    "suffix",
    "response_format",
    "structured_outputs",
]
CHAT_FIELDS = [
    *(f for f in COMPLETION_FIELDS if f not in ("prompt", "echo", "best_of", "suffix")),
    "messages",
    "max_completion_tokens",
    "add_generation_prompt",
    "top_logprobs",
    "tools",
    "tool_choice",
]
BAD_MESSAGES = [
    "[{}]",
    '[{"role": "user"}]',
    '[{"content": "hi"}]',
    '[{"role": "wizard", "content": "hi"}]',
    '[{"role": "user", "content": 5}]',
    '[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]',
    '[{"role": "user", "content": [{"type": "text"}]}]',
    '[{"role": "user", "content": [5]}]',
    '[{"role": "user", "content": "hi", "name": 3}]',
    '["hi"]',
    '[{"role": "user", "content": "' + "{{ 7*7 }}{% for x in range(99999999) %}" + '"}]',
]


def nested(levels: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


WEATHER_TOOL = {"type": "function", "function": {"name": "f", "parameters": nested(3)}}
# Grammars that are hostile, huge, deep, empty, or at odds with the other controls.
STRUCTURED: list[dict[str, object]] = [
    {"structured_outputs": {"json": nested(20)}, "max_tokens": 16},
    {"structured_outputs": {"json": nested(900)}},
    {"structured_outputs": {"json": "[" * 100_000}},
    {"structured_outputs": {"json": {"$ref": "#/nope"}}},
    {"structured_outputs": {"json": {"type": "integer", "minimum": 9, "maximum": 1}}},
    {"structured_outputs": {"regex": "(a|b)*" * 2000}},
    {"structured_outputs": {"regex": "\u0000"}},
    {"structured_outputs": {"regex": "a{0,100000}", "choice": ["a"]}},
    {"structured_outputs": {"grammar": "root ::= root"}, "max_tokens": 4},
    {"structured_outputs": {"grammar": 'root ::= "a" | ' * 5000 + '"b"'}},
    {"structured_outputs": {"choice": ["x" * 1024] * 256}, "max_tokens": 2},
    {"structured_outputs": {"choice": [f"{i:04}" + "x" * 252 for i in range(64)]}},
    {"structured_outputs": {"choice": ["a"]}, "min_tokens": 5, "max_tokens": 8},
    {"structured_outputs": {"regex": "a+"}, "logit_bias": {"97": -100}, "temperature": 2},
    {"structured_outputs": {"json_object": True}, "bad_words": ["{"], "n": 4},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": True}}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": nested(2)}},
     "structured_outputs": {"regex": "a"}},
    {"response_format": {"type": "json_object"}, "stream": True, "max_tokens": 16, "n": 3},
    {"tools": [WEATHER_TOOL] * 128, "tool_choice": "required", "max_tokens": 16, "stream": True},
    {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}},
     "min_tokens": 16, "max_tokens": 16, "n": 2},
    {"tools": [{"type": "function", "function": {"name": "g", "parameters": nested(900)}}],
     "tool_choice": "required"},
]  # fmt: skip

# Sampling controls and logprobs at their limits and in odd company: each a 200 or a 400.
EXTREMES: list[dict[str, object]] = [
    {"logprobs": 20, "echo": True, "prompt": "z" * 500, "n": 16, "max_tokens": 8},
    {"logprobs": 20, "echo": True, "prompt": [256] * 600},
    {"prompt_logprobs": 20, "logprobs": 0, "n": 4, "stream": True},
    {"prompt_logprobs": 0, "stream": True, "echo": True},
    {"logprobs": True, "top_logprobs": 20, "stream": True, "max_tokens": 20},
    {"logit_bias": {str(i): -100 for i in range(258)}, "temperature": 1},
    {"logit_bias": {str(i): 1e300 for i in range(300)}},
    {"logit_bias": {"0" * 400 + "1": 5, "1" * 30: 5}},
    {"bad_words": ["a" * 1000 + str(i) for i in range(1000)], "max_tokens": 16},
    {"bad_words": [chr(i) for i in range(33, 256)], "min_tokens": 4, "max_tokens": 4},
    {"bad_words": [" ", "\t"]},
    {"repetition_penalty": 1e-300, "temperature": 1, "max_tokens": 8},
    {"repetition_penalty": 1e300, "presence_penalty": -2, "frequency_penalty": -2},
    {"min_p": 1, "top_p": 1e-9, "top_k": 1, "temperature": 2, "seed": 2**63 - 1},
    {"min_tokens": 2**20, "max_tokens": 2**20},
    {"min_tokens": 8, "max_tokens": 8, "stop": ["a"], "stop_token_ids": [257]},
    *STRUCTURED,
]

VALID_COMPLETION = {"prompt": "hello", "max_tokens": 1}
VALID_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@dataclass
class Probe:
    method: str
    path: str
    body: bytes
    content_type: str | None = "application/json"


def with_field(base: dict[str, object], field: str, raw_value: str) -> bytes:
    """`base` with `field` set to the raw JSON text `raw_value`."""
    rest = {k: v for k, v in base.items() if k != field}
    head = json.dumps(rest)[:-1]
    sep = ", " if rest else ""
    return f'{head}{sep}"{field}": {raw_value}}}'.encode()


def probes(seed: int, router: bool) -> list[Probe]:
    rng = random.Random(seed)
    out: list[Probe] = []
    for path, base, fields in (
        ("/v1/completions", VALID_COMPLETION, COMPLETION_FIELDS),
        ("/v1/chat/completions", VALID_CHAT, CHAT_FIELDS),
    ):
        for field in fields:
            for value in BAD_VALUES:
                out.append(Probe("POST", path, with_field(base, field, value)))
        valid = json.dumps(base).encode()
        for _ in range(150):  # truncated JSON
            out.append(Probe("POST", path, valid[: rng.randrange(len(valid))]))
        for _ in range(100):  # not UTF-8, or not JSON at all
            out.append(Probe("POST", path, rng.randbytes(rng.randrange(1, 300))))
        for _ in range(50):  # valid JSON of the wrong shape
            out.append(
                Probe("POST", path, json.dumps(rng.choice([[], 1, "x", None, [base]])).encode())
            )
        out += [
            Probe("POST", path, b"[" * 1_000_000),
            Probe("POST", path, b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
            Probe("POST", path, b" " * (5 << 20)),  # over the 4 MiB limit
            Probe("POST", path, b'{"prompt": "' + b"y" * (3 << 20) + b'", "max_tokens": 1}'),
            Probe("POST", path, valid, content_type=None),
            Probe("POST", path, valid, content_type="text/plain"),
            Probe("GET", path, b""),
            Probe("PUT", path, valid),
            Probe("DELETE", path, b""),
        ]
    for extreme in EXTREMES:
        out.append(
            Probe("POST", "/v1/completions", json.dumps({**VALID_COMPLETION, **extreme}).encode())
        )
        chat = {k: v for k, v in extreme.items() if k not in ("prompt", "echo", "prompt_logprobs")}
        if isinstance(chat.get("logprobs"), int) and chat["logprobs"] is not True:
            chat["top_logprobs"], chat["logprobs"] = chat["logprobs"], True
        out.append(
            Probe("POST", "/v1/chat/completions", json.dumps({**VALID_CHAT, **chat}).encode())
        )
    for messages in BAD_MESSAGES:
        out.append(
            Probe("POST", "/v1/chat/completions", with_field(VALID_CHAT, "messages", messages))
        )
    for _ in range(100):  # mutations: a valid body with one byte changed
        body = bytearray(json.dumps(VALID_COMPLETION).encode())
        body[rng.randrange(len(body))] = rng.randrange(256)
        out.append(Probe("POST", "/v1/completions", bytes(body)))
    for path in ("/", "/v1", "/v1/embeddings", "/health/../metrics", "/%ff", "/v1/models/x" * 50):
        out.append(Probe("GET", path, b""))
    if router:
        for value in BAD_VALUES:
            out.append(Probe("POST", "/kv/score", with_field(VALID_COMPLETION, "prompt", value)))
    rng.shuffle(out)
    return out


def send(port: int, probe: Probe) -> int:
    """The status of one probe on a fresh connection; 0 if the server gave no answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        headers = {} if probe.content_type is None else {"Content-Type": probe.content_type}
        conn.request(probe.method, probe.path, body=probe.body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except TimeoutError:
        return -1  # a hang
    except (ConnectionError, http.client.HTTPException):
        # The server may close a connection whose body it refused before reading it (413);
        # what counts is that it stays up, which the valid request after every 100 checks.
        return 0
    finally:
        conn.close()


def valid_request_succeeds(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(VALID_COMPLETION))
        resp = conn.getresponse()
        body = json.loads(resp.read())
        return resp.status == 200 and body["usage"]["completion_tokens"] == 1
    finally:
        conn.close()


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Serve, RouterProcess]]:
    """One instance fuzzed directly, and the router in front of it and a second one (as the
    issue's run: the router's retries and both relays are in play)."""
    tmp = tmp_path_factory.mktemp("fuzz")
    server, second = Serve(tmp, "--max-model-len", "512"), Serve(tmp, "--max-model-len", "512")
    server.start()
    second.start()
    router = RouterProcess(tmp, [server, second])
    try:
        router.start()
        yield server, router
    finally:
        router.stop()
        second.stop()
        server.stop()


@pytest.mark.parametrize("target", ["serve", "router"])
def test_thousands_of_hostile_requests_get_4xx_and_break_nothing(
    targets: tuple[Serve, RouterProcess], target: str
) -> None:
    server, router = targets
    proc = server if target == "serve" else router
    batch = probes(seed=12 if target == "serve" else 21, router=target == "router")
    assert len(batch) >= 2000
    statuses: Counter[int] = Counter()
    bad: list[tuple[int, Probe]] = []
    with ThreadPoolExecutor(8) as pool:  # eight clients at once
        for start in range(0, len(batch), 100):
            chunk = batch[start : start + 100]
            for status, probe in zip(pool.map(partial(send, proc.port), chunk), chunk, strict=True):
                statuses[status] += 1
                if status >= 500 or status == -1:
                    bad.append((status, probe))
            assert valid_request_succeeds(proc.port), f"after {start + 100}: {proc.logs()}"
    shown = [(s, p.method, p.path, p.body[:120]) for s, p in bad[:5]]
    assert not bad, f"{len(bad)} 5xx or hung, e.g. {shown}"
    assert server.alive() and router.alive()
    assert get(proc.url + "/health")[0] == 200
    assert statuses[200] + statuses[400] + statuses[404] + statuses[405] + statuses[413] + statuses[
        0
    ] == sum(statuses.values()), statuses
    assert statuses[400] > 1500  # most of them are refused, each with its reason


def test_a_flood_of_valid_and_invalid_requests_at_once(
    targets: tuple[Serve, RouterProcess],
) -> None:
    server, router = targets
    rng = random.Random(7)
    hostile = probes(seed=7, router=False)  # built once: each set holds ~20 MB of bodies
    mixed = [
        Probe(
            "POST",
            "/v1/completions",
            json.dumps({**VALID_COMPLETION, "prompt": f"flood {i}"}).encode(),
        )
        if i % 3 == 0
        else rng.choice(hostile)
        for i in range(600)
    ]
    for proc in (server, router):
        with ThreadPoolExecutor(64) as pool:
            statuses = list(pool.map(partial(send, proc.port), mixed))
        assert all(0 <= s < 500 for s in statuses), Counter(statuses)
        assert statuses.count(200) >= 200
    assert server.alive() and router.alive()


def test_clients_that_stall_mid_request_do_not_block_others(
    targets: tuple[Serve, RouterProcess],
) -> None:
    server, router = targets
    for proc in (server, router):
        stalled = []
        for i in range(50):
            s = socket.create_connection(("127.0.0.1", proc.port))
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"
            s.sendall(head if i % 2 else head[:20])  # half a body, or half the headers
            stalled.append(s)
        try:
            assert valid_request_succeeds(proc.port)
        finally:
            for s in stalled:
                s.close()
        assert valid_request_succeeds(proc.port)
