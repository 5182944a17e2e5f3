"""An OpenAI completions backend that answers at once with a fixed body (or a two-chunk
stream; a P/D prefill's params to a request with do_remote_decode): what `bench/routers.py`
puts behind a router to measure the router's own cost.
Not a benchmark itself: `python bench/_stub_backend.py PORT`."""

import asyncio
import sys

BODY = (
    b'{"id":"x","object":"text_completion","created":0,"model":"tiny","choices":[{"index":0,'
    b'"text":"a","finish_reason":"length","logprobs":null}],"usage":{"prompt_tokens":528,'
    b'"completion_tokens":1,"total_tokens":529,"prompt_tokens_details":{"cached_tokens":0}}}'
)
CHUNKS = (b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n',
          b"data: [DONE]\n\n")  # fmt: skip
PREFILLED = BODY[:-1] + (
    b',"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,'
    b'"remote_engine_id":"stub","remote_block_ids":[],"remote_host":"127.0.0.1",'
    b'"remote_port":1}}'
)
"""A P/D prefill's answer (a request with do_remote_decode): the params D would get."""
OK = b"HTTP/1.1 200 OK\r\nContent-Type: "


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            lengths = [ln for ln in head.split("\r\n") if ln.lower().startswith("content-length:")]
            n = int(lengths[0].split(":")[1]) if lengths else 0
            body = await reader.readexactly(n) if n else b""
            if head.startswith("GET"):
                writer.write(OK + b"application/json\r\nContent-Length: 2\r\n\r\n{}")
            elif b'"stream": true' in body:
                writer.write(OK + b"text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                for part in CHUNKS:
                    writer.write(b"%x\r\n" % len(part) + part + b"\r\n")
                writer.write(b"0\r\n\r\n")
            else:
                prefill = b'"do_remote_decode":true' in body or b'"do_remote_decode": true' in body
                answer = PREFILLED if prefill else BODY
                writer.write(OK + b"application/json\r\nContent-Length: %d\r\n\r\n" % len(answer))
                writer.write(answer)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()


async def main(port: int) -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__" and len(sys.argv) == 2:
    asyncio.run(main(int(sys.argv[1])))
