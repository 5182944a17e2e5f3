"""From sampled tokens to output text: detokenizing, stop strings, what may be streamed yet.

Stop token ids end a request in the scheduler (as EOS does); stop *strings* can only be seen
in the text, so each step the engine decodes every running request's output here:

    output tokens  ... "Par" "is" "." "\\n" "\\n"        stop=["\\n\\n"]
    text           "The capital is Paris.\\n\\n"  -> cut to "The capital is Paris."
                                                   stop_reason "\\n\\n", the request finishes

While a request runs, its last `max(len(stop)) - 1` characters are held back from streaming:
they might yet become the start of a stop string, which the client must never see. A
character that the tokenizer cannot complete yet (half a UTF-8 sequence, shown as U+FFFD) is
held back too, and the holdback counts from before it.

What a step hands out per request is a `RequestDelta` (`RequestState.take_delta`): the tokens
and the text not handed out before, and how the request ended once it has. `request_output`
joins a prompt's finished requests and their deltas into vLLM's `RequestOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvconnect.engine.request import CompletionOutput, Request, RequestOutput
from kvconnect.messages import PositionLogprobs, PromptLogprobs
from kvconnect.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """One request's progress since its previous delta (what `LLM.step()` returns)."""

    request: Request
    """The request itself, for its prompt and totals (read it; never change it)."""
    token_ids: list[int]
    """Output tokens new since the previous delta (all of them are final)."""
    text: str
    """Text new since the previous delta; held-back characters come in a later one."""
    finish_reason: str | None = None
    """Set on the request's last delta: "stop", "length", "abort" or "error"."""
    stop_reason: str | int | None = None
    """On the last delta: the stop string or stop token id that ended it, if one did."""
    logprobs: list[PositionLogprobs] | None = None
    """One per token of token_ids, if the request asked (`SamplingParams.logprobs`)."""
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """On the request's first delta with tokens, if it asked (`SamplingParams.prompt_logprobs`):
    one per prompt token, the first None (as vLLM's)."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        """True on the request's last delta: no other follows."""
        return self.finish_reason is not None


@dataclass
class RequestState:
    """One request's output as text, and how much of it has been handed out."""

    request: Request
    text: str = ""
    """The output decoded so far, cut before a stop string that ended it."""
    num_sent: int = 0
    """Characters of `text` already handed out by `take_delta`."""
    num_sent_tokens: int = 0
    """Output tokens already handed out by `take_delta`."""
    stop_reason: str | int | None = None
    """The stop string (or stop token id) that ended the request; None otherwise."""
    logprobs: list[PositionLogprobs] | None = None
    """One per output token so far, if the request asked."""
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """One per prompt token, filled as prefill chunks compute them, if the request asked."""
    _holdback: int = field(default=0, repr=False)

    def add_logprobs(self, logprobs: PositionLogprobs | None) -> None:
        """The logprobs of the token a step sampled; kept only if the token was (a token
        whose blocks failed to load is dropped and sampled again)."""
        mine = self.logprobs
        if mine is None or logprobs is None:
            return
        if len(mine) < len(self.request.output_token_ids):
            mine.append(logprobs)

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """A step's prompt positions (a recomputed position is written again, the same)."""
        if self.prompt_logprobs is not None:
            self.prompt_logprobs[chunk.start : chunk.start + len(chunk.logprobs)] = chunk.logprobs

    def take_delta(self) -> RequestDelta | None:
        """The tokens and text not handed out before, with the end once the request has
        finished; None while it runs and nothing is new."""
        req = self.request
        first, token_ids = self.num_sent_tokens, req.output_token_ids[self.num_sent_tokens :]
        finished = req.status.is_finished
        if not token_ids and not finished:
            return None
        self.num_sent_tokens += len(token_ids)
        logprobs = None if self.logprobs is None else self.logprobs[first : self.num_sent_tokens]
        prompt_logprobs = self.prompt_logprobs if first == 0 and token_ids else None
        if not finished:
            return RequestDelta(
                req, token_ids, self._take_text(), None, None, logprobs, prompt_logprobs
            )
        return RequestDelta(
            req,
            token_ids,
            self._take_text(),
            req.status.finish_reason,
            self.stop_reason,
            logprobs,
            prompt_logprobs,
        )

    def _take_text(self) -> str:
        """Text not handed out before that can no longer change or turn into a stop string."""
        end = len(self.text)
        if not self.request.status.is_finished:
            while end > self.num_sent and self.text[end - 1] == "\ufffd":
                end -= 1  # an incomplete character: wait for the rest of its bytes
            # ...and hold back before it: with it, they may yet make a stop string.
            end = max(self.num_sent, end - self._holdback)
        delta, self.num_sent = self.text[self.num_sent : end], end
        return delta


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def add(self, request: Request) -> RequestState:
        params = request.sampling_params
        state = RequestState(request, _holdback=max((len(s) for s in params.stop), default=1) - 1)
        if params.logprobs is not None:
            state.logprobs = []
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(request.prompt_token_ids)
        return state

    def update(self, state: RequestState) -> bool:
        """Decode the request's output; True if a stop string ends it now (the caller then
        finishes the request)."""
        req = state.request
        text = self.tokenizer.decode(req.output_token_ids)
        stops = req.sampling_params.stop
        # As vLLM: no stop string ends the output before min_tokens (nor is looked for).
        if (
            stops
            and state.stop_reason is None
            and len(req.output_token_ids) > req.sampling_params.min_tokens
        ):
            # Only the new tail can hold a stop string that was not there before. The text
            # before it is stable up to its first incomplete character (which may yet merge).
            pending = state.text.find("\ufffd")
            stable = len(state.text) if pending < 0 else pending
            start = max(0, stable - max(len(s) for s in stops) + 1)
            hits = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
            if hits:
                cut, stop = min(hits)
                state.text, state.stop_reason = text[:cut], stop
                return True
        if state.stop_reason is None:
            state.text = text
            last = req.output_token_ids[-1] if req.output_token_ids else None
            if last is not None and last in req.sampling_params.stop_token_ids:
                state.stop_reason = last
        return False


def request_output(
    requests: list[Request], prompt: str | None, deltas: dict[str, list[RequestDelta]]
) -> RequestOutput:
    """One prompt's output from its n finished requests and the deltas each handed out."""
    outputs = []
    for j, r in enumerate(requests):
        mine = deltas.get(r.request_id, [])
        logprobs = None
        if r.sampling_params.logprobs is not None:
            logprobs = [lp for d in mine for lp in d.logprobs or ()]
        outputs.append(
            CompletionOutput(
                j,
                "".join(d.text for d in mine),
                list(r.output_token_ids),
                r.status.finish_reason,
                mine[-1].stop_reason if mine else None,
                logprobs,
            )
        )
    first = requests[0]
    firsts = deltas.get(first.request_id, [])
    prompt_logprobs = next((d.prompt_logprobs for d in firsts if d.prompt_logprobs), None)
    return RequestOutput(
        request_id=first.request_id,
        prompt=prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=outputs,
        finished=all(r.status.is_finished for r in requests),
        num_cached_tokens=first.num_cached_tokens or 0,
        num_external_tokens=first.num_external_tokens,
        kv_transfer_params=first.kv_transfer_params,
        prompt_logprobs=prompt_logprobs,
    )
