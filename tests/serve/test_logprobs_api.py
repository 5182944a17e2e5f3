"""Logprobs through the OpenAI Python client, against `kvconnect serve` and the router in front:
completions' `logprobs`, `echo` and vLLM's `prompt_logprobs`, chat's `logprobs` +
`top_logprobs`, whole and streamed, each value the engine's own (an `LLM` on the same seeded
weights in this process; the engine's values are checked against transformers in
tests/engine/test_llm_sampling.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types import Completion

from kvconnect import LLM, SamplingParams
from kvconnect.messages import PositionLogprobs
from kvconnect.model.tokenizer import ByteTokenizer
from tests.serving import RouterProcess, Serve, post

pytestmark = pytest.mark.slow

PROMPT = "Hello there"
GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0, "extra_body": {"ignore_eos": True}}
TOK = ByteTokenizer()


def text_of(token_id: int) -> str:
    """A token's text alone."""
    return TOK.decode([token_id])


def assert_shown(token_id: int, shown: str) -> None:
    """`shown` is how vLLM shows the token: its text alone, unless that is an incomplete
    character (the byte model's bytes 128-255); then the character it completes, or ""."""
    alone = text_of(token_id)
    if alone.endswith("\ufffd"):
        assert not shown.endswith("\ufffd") and (shown == "" or ord(shown[-1]) >= 128), shown
    else:
        assert shown == alone


@pytest.fixture(scope="module")
def served(tiny_api: tuple[Serve, RouterProcess]) -> tuple[Serve, RouterProcess]:
    return tiny_api  # tests/serve/conftest.py (module scope keeps the module on one worker)


@pytest.fixture(scope="module")
def engine() -> Iterator[LLM]:
    with LLM("tiny") as llm:
        yield llm


@pytest.fixture(params=["serve", "router"])
def client(request: pytest.FixtureRequest, served: tuple[Serve, RouterProcess]) -> openai.OpenAI:
    target = served[0] if request.param == "serve" else served[1]
    return openai.OpenAI(base_url=target.url + "/v1", api_key="unused", max_retries=0)


def reference(
    engine: LLM,
    prompt: str | list[int],
    max_tokens: int,
    logprobs: int,
    prompt_logprobs: int | None = None,
) -> tuple[list[int], list[PositionLogprobs], list[PositionLogprobs | None] | None]:
    """The engine's greedy tokens, their logprobs and the prompt's."""
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    out = engine.generate(prompt, params)[0]
    choice = out.outputs[0]
    assert choice.logprobs is not None
    return choice.token_ids, choice.logprobs, out.prompt_logprobs


def entries(p: PositionLogprobs) -> dict[int, float]:
    """vLLM's entries of a position: its token first, then the top ones, each id once."""
    by_id = {p.token_id: p.logprob}
    for t, lp in zip(p.top_token_ids, p.top_logprobs, strict=True):
        by_id.setdefault(t, lp)
    return by_id


def own_key(token_id: int) -> bool:
    """Whether no other token can show as this one: its text is complete and not empty (the
    byte model's BOS and EOS are "", as an incomplete byte may be)."""
    alone = text_of(token_id)
    return bool(alone) and not alone.endswith("\ufffd")


def assert_completion_logprobs(
    got: Any, positions: list[PositionLogprobs | None], token_ids: list[int]
) -> None:
    assert len(got.tokens) == len(token_ids)
    for token_id, shown in zip(token_ids, got.tokens, strict=True):
        assert_shown(token_id, shown)
    offsets = [0]
    for token in got.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert got.text_offset == offsets
    for p, lp, top in zip(positions, got.token_logprobs, got.top_logprobs, strict=True):
        if p is None:
            assert lp is None and top is None
            continue
        assert lp == pytest.approx(p.logprob, abs=1e-4)
        # Keyed by text: the complete ones are each token's own; tokens shown alike (the
        # incomplete bytes) share a key, the later value (as vLLM's dict).
        by_id = entries(p)
        complete = {text_of(t): lp for t, lp in by_id.items() if own_key(t)}
        assert {k: top[k] for k in complete} == pytest.approx(complete, abs=1e-4)
        others = set(top) - set(complete)
        assert len(others) <= len(by_id) - len(complete)
        assert all(not k.endswith("\ufffd") for k in others)


def test_completion_logprobs_are_the_engines_and_greedy_picks_rank_one(
    client: openai.OpenAI, engine: LLM
) -> None:
    token_ids, positions, _ = reference(engine, PROMPT, 6, 3)
    choice = client.completions.create(prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY).choices[0]
    assert choice.logprobs is not None
    assert_completion_logprobs(choice.logprobs, list(positions), token_ids)
    for p, lp, top in zip(
        positions,
        choice.logprobs.token_logprobs or [],
        choice.logprobs.top_logprobs or [],
        strict=True,
    ):
        # Greedy: the most likely. (Not `==`: the byte model's tokens 128-255 all read "\ufffd",
        # and a later one of them overwrites the value under that key, as in vLLM.)
        assert p.rank == 1 and lp is not None and lp >= max(top.values())
    assert choice.text == TOK.decode(token_ids)
    assert "prompt_logprobs" not in (choice.model_extra or {})


def test_streamed_completion_logprobs_join_to_the_whole_ones(client: openai.OpenAI) -> None:
    whole = client.completions.create(prompt=PROMPT, max_tokens=7, logprobs=2, **GREEDY)
    chunks = list(
        client.completions.create(prompt=PROMPT, max_tokens=7, logprobs=2, stream=True, **GREEDY)
    )
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    joined = {
        key: [x for part in parts for x in getattr(part, key) or ()]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    assert whole.choices[0].logprobs is not None
    assert joined == whole.choices[0].logprobs.model_dump()
    assert len(joined["tokens"]) == 7


def test_echo_puts_the_prompt_first_and_its_logprobs_start_with_null(
    client: openai.OpenAI, engine: LLM
) -> None:
    plain = client.completions.create(prompt=PROMPT, max_tokens=4, **GREEDY).choices[0]
    echoed = client.completions.create(prompt=PROMPT, max_tokens=4, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain.text
    assert echoed.choices[0].logprobs is None
    token_ids, positions, prompt_positions = reference(engine, PROMPT, 4, 1, prompt_logprobs=1)
    assert prompt_positions is not None and prompt_positions[0] is None
    prompt_ids = TOK.encode(PROMPT)
    for stream in (False, True):
        got = client.completions.create(
            prompt=PROMPT, max_tokens=4, echo=True, logprobs=1, stream=stream, **GREEDY
        )
        chunks = [got] if isinstance(got, Completion) else list(got)
        text = "".join(c.choices[0].text for c in chunks)
        assert text == PROMPT + plain.text
        merged = chunks[0].choices[0].logprobs
        for c in chunks[1:]:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(merged, key).extend(getattr(c.choices[0].logprobs, key))
        assert_completion_logprobs(
            merged, [*prompt_positions, *positions], [*prompt_ids, *token_ids]
        )


def test_echoed_characters_of_several_bytes_join_back_to_the_prompt(
    client: openai.OpenAI,
) -> None:
    # vLLM's reading: a byte that leaves a character incomplete is "", the byte that
    # completes it is the character (decoded after the bytes before it).
    prompt = "café ☕ naïve"
    for stream in (False, True):
        got = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=0, stream=stream
        )
        chunks = [got] if isinstance(got, Completion) else list(got)
        lp = chunks[0].choices[0].logprobs
        assert lp is not None and lp.tokens is not None and lp.text_offset is not None
        assert "".join(lp.tokens) == prompt
        assert lp.tokens[3:5] == ["", "é"] and lp.tokens[6:9] == ["", "", "☕"]
        for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
            assert prompt[offset : offset + len(token)] == token
    choice = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0}
    ).choices[0]
    shown = [
        next(iter(e.values()))["decoded_token"] for e in choice.model_extra["prompt_logprobs"][1:]
    ]  # type: ignore[index]
    assert "".join(shown) == prompt[1:]


def test_prompt_logprobs_are_vllms_dicts_and_not_streamed(
    client: openai.OpenAI, engine: LLM
) -> None:
    _, _, prompt_positions = reference(engine, PROMPT, 2, 0, prompt_logprobs=2)
    choice = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=2,
        extra_body={"prompt_logprobs": 2, "ignore_eos": True},
    ).choices[0]
    assert choice.logprobs is None  # asked for the prompt's only
    got = (choice.model_extra or {})["prompt_logprobs"]
    assert prompt_positions is not None and len(got) == len(PROMPT) and got[0] is None
    for p, entry in zip(prompt_positions[1:], got[1:], strict=True):
        assert p is not None
        ids = [p.token_id, *(t for t in p.top_token_ids if t != p.token_id)]
        assert list(entry) == [str(t) for t in ids]
        mine = entry[str(p.token_id)]
        assert mine["rank"] == p.rank
        assert_shown(p.token_id, mine["decoded_token"])
        assert mine["logprob"] == pytest.approx(p.logprob, abs=1e-4)
        ranks = [entry[str(t)]["rank"] for t in p.top_token_ids if t != p.token_id]
        assert ranks == [r for r, t in enumerate(p.top_token_ids, 1) if t != p.token_id]
    with pytest.raises(openai.BadRequestError) as streamed:
        client.completions.create(
            model="tiny", prompt=PROMPT, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert streamed.value.param == "prompt_logprobs"


MESSAGES: Any = [{"role": "user", "content": "Say something."}]


def test_chat_logprobs_whole_and_per_delta(
    client: openai.OpenAI, engine: LLM, served: tuple[Serve, RouterProcess]
) -> None:
    reply = client.chat.completions.create(
        messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = reply.choices[0].logprobs and reply.choices[0].logprobs.content
    assert content is not None and len(content) == 5
    _, rendered, _ = post(served[0].url + "/tokenize", {"messages": MESSAGES})
    _, positions, _ = reference(engine, rendered["tokens"], 5, 3)
    for item, p in zip(content, positions, strict=True):
        assert_shown(p.token_id, item.token)
        assert item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(p.logprob, abs=1e-4)
        for t, top in zip(p.top_token_ids, item.top_logprobs, strict=True):
            assert_shown(t, top.token)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(p.top_logprobs, abs=1e-4)
        assert item.top_logprobs[0].token == item.token and p.rank == 1  # greedy: the top
    # (The tokens join to the content where it is valid UTF-8: test_text_api_smollm2.py.)
    stream = list(
        client.chat.completions.create(
            messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3, stream=True, **GREEDY
        )
    )
    streamed = [
        item
        for c in stream
        if c.choices[0].logprobs
        for item in c.choices[0].logprobs.content or ()
    ]
    assert [i.model_dump() for i in streamed] == [i.model_dump() for i in content]
    bare = client.chat.completions.create(messages=MESSAGES, max_tokens=2, logprobs=True, **GREEDY)
    bare_content = bare.choices[0].logprobs and bare.choices[0].logprobs.content
    assert bare_content and all(item.top_logprobs == [] for item in bare_content)
    plain = client.chat.completions.create(messages=MESSAGES, max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_chat_prompt_logprobs_are_the_answers_own(
    client: openai.OpenAI, engine: LLM, served: tuple[Serve, RouterProcess]
) -> None:
    _, rendered, _ = post(served[0].url + "/tokenize", {"messages": MESSAGES})
    _, _, positions = reference(engine, rendered["tokens"], 1, 0, prompt_logprobs=1)
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    got = (reply.model_extra or {})["prompt_logprobs"]
    assert positions is not None and len(got) == len(rendered["tokens"]) and got[0] is None
    for p, entry in zip(positions[1:], got[1:], strict=True):
        assert p is not None
        assert entry[str(p.token_id)]["logprob"] == pytest.approx(p.logprob, abs=1e-4)
        assert entry[str(p.token_id)]["rank"] == p.rank
    assert reply.choices[0].logprobs is None


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client: openai.OpenAI, engine: LLM) -> None:
    _, _, prompt_positions = reference(engine, PROMPT, 1, 2, prompt_logprobs=2)
    assert prompt_positions is not None
    for stream in (False, True):
        got = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, stream=stream
        )
        chunks = [got] if isinstance(got, Completion) else list(got)
        assert "".join(c.choices[0].text for c in chunks) == PROMPT
        logprobs = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        assert_completion_logprobs(logprobs[0], list(prompt_positions), TOK.encode(PROMPT))
        assert all(not lp.tokens for lp in logprobs[1:])
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert bad.value.param == "max_tokens"
