"""The local engine's HTTP side: a threading server that can drop its connections, and the
handler that speaks enough of the OpenAI and Anthropic APIs for their clients."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from jiuwen_kv_protocol.headers import CAPABILITIES_PATH, RELEASE_PATH
from jiuwen_kv_protocol.models import ReleaseReceipt

from ._records import CAPABILITIES, RecordedRequest, _Records

OPENAI_CHAT_FIELDS = frozenset(
    [
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "messages",
        "metadata",
        "modalities",
        "model",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    ]
)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512  # many agents connecting at once must not be refused

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        """Close the kept-alive connections too, as a server that dies does (a proxy in front
        must see this server gone, not keep using its open connections)."""
        with self._open_lock:
            open_now, self._open = list(self._open), set()
        for connection in open_now:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up (timeout) or a reset we caused ourselves is not an error here.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate writes: no 40 ms ACK stalls
    records: _Records
    reply: str

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    def _read(self) -> RecordedRequest:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length).decode("utf-8", "replace") if length else ""
        try:
            body: Any = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            body = raw
        headers = {k.lower(): v for k, v in self.headers.items()}
        return RecordedRequest(self.path, headers, body)

    def _send(self, status: int, payload: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _error(self, status: int, message: str, kind: str = "NotFoundError") -> None:
        body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        self._send(status, json.dumps(body).encode())

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": []}).encode())
        elif self.path == CAPABILITIES_PATH and self.records.in_request:
            if self.records.capabilities_delay:
                time.sleep(self.records.capabilities_delay)
            self._send(200, json.dumps(CAPABILITIES).encode())
        else:
            self._error(404, "Not Found")

    def do_POST(self) -> None:
        request = self._read()
        with self.records.lock:
            self.records.paths.append(self.path)
        if self.path == RELEASE_PATH:
            self._release(request)
        elif self.path == "/v1/responses":
            with self.records.lock:
                self.records.chats.append(request)
            self._response(request)
        elif self.path.partition("?")[0] == "/v1/messages":
            with self.records.lock:
                self.records.chats.append(request)
            self._message(request)
        elif self.path == "/v1/chat/completions":
            with self.records.lock:
                self.records.chats.append(request)
            unknown = sorted(set(request.body or {}) - OPENAI_CHAT_FIELDS)
            if self.records.strict and unknown:
                message = f"Unrecognized request argument supplied: {', '.join(unknown)}"
                self._error(400, message, "invalid_request_error")
            else:
                self._chat(request)
        else:
            self._error(404, "Not Found")

    def _release(self, request: RecordedRequest) -> None:
        with self.records.lock:
            self.records.releases.append(request)
            self.records.lock.notify_all()
            answer = self.records.answer
        if answer.delay:
            time.sleep(answer.delay)
        if answer.reset:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"cache_salt": ')
            self.wfile.flush()
            # SO_LINGER 0: close with a TCP RST instead of a clean FIN.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        if answer.non_json:
            self._send(answer.status, b"<html>surprise</html>", "text/html")
            return
        if answer.status != 200:
            self._error(answer.status, f"release answered {answer.status}")
            return
        body = request.body if isinstance(request.body, dict) else {}
        blocks = answer.block_released
        if blocks is None:
            window = len(body.get("messages") or body.get("input") or [])
            window += 1 if body.get("instructions") or body.get("system") else 0
            blocks = max(0, window - int(body.get("messages_released_index") or 0))
        capabilities = CAPABILITIES if self.records.in_request else None
        receipt = ReleaseReceipt(block_released=blocks, capabilities=capabilities)
        answer_body = {
            "cache_salt": body.get("cache_salt"),
            **receipt.model_dump(exclude_none=True),
        }
        self._send(200, json.dumps(answer_body).encode())

    def _chat(self, request: RecordedRequest) -> None:
        body = request.body if isinstance(request.body, dict) else {}
        model = body.get("model", "local")
        created = int(time.time())
        text = f"{self.reply} ({len(body.get('messages') or [])} messages)"
        if not body.get("stream"):
            completion = {
                "id": "chatcmpl-local",
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
            self._send(200, json.dumps(completion).encode())
            return
        deltas = [{"role": "assistant", "content": ""}, {"content": text}, {}]
        events = []
        for i, delta in enumerate(deltas):
            chunk = {
                "id": "chatcmpl-local",
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {"index": 0, "delta": delta, "finish_reason": "stop" if i == 2 else None}
                ],
            }
            events.append(f"data: {json.dumps(chunk)}\n\n")
        events.append("data: [DONE]\n\n")
        self._send(200, "".join(events).encode(), "text/event-stream")

    def _response(self, request: RecordedRequest) -> None:
        body = request.body if isinstance(request.body, dict) else {}
        raw_input = body.get("input")
        count = 1 if isinstance(raw_input, str) else len(raw_input or [])
        text = f"{self.reply} ({count} items)"
        response = _response_object(str(body.get("model", "local")), text, int(time.time()))
        if not body.get("stream"):
            self._send(200, json.dumps(response).encode())
            return
        item = response["output"][0]
        in_progress = {**response, "status": "in_progress", "output": []}
        events = [
            ("response.created", {"response": in_progress}),
            ("response.output_item.added", {"output_index": 0, "item": {**item, "content": []}}),
            (
                "response.output_text.delta",
                {"item_id": item["id"], "output_index": 0, "content_index": 0, "delta": text},
            ),
            ("response.output_item.done", {"output_index": 0, "item": item}),
            ("response.completed", {"response": response}),
        ]
        payload = "".join(
            f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': i, **data})}\n\n"
            for i, (kind, data) in enumerate(events)
        )
        self._send(200, payload.encode(), "text/event-stream")

    def _message(self, request: RecordedRequest) -> None:
        """An Anthropic Messages answer: a JSON message, or its event stream."""
        body = request.body if isinstance(request.body, dict) else {}
        text = f"{self.reply} ({len(body.get('messages') or [])} messages)"
        usage = {"input_tokens": 1, "output_tokens": 1}
        message = {
            "id": "msg_local",
            "type": "message",
            "role": "assistant",
            "model": str(body.get("model", "local")),
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": usage,
        }
        if not body.get("stream"):
            self._send(200, json.dumps(message).encode())
            return
        events = [
            ("message_start", {"message": {**message, "content": [], "stop_reason": None}}),
            ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}),
            ("content_block_stop", {"index": 0}),
            ("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": usage}),
            ("message_stop", {}),
        ]
        payload = "".join(
            f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"
            for kind, data in events
        )
        self._send(200, payload.encode(), "text/event-stream")


def _response_object(model: str, text: str, created: int) -> dict[str, Any]:
    return {
        "id": "resp_local",
        "object": "response",
        "created_at": created,
        "model": model,
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": "msg_local",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "temperature": 1.0,
        "top_p": 1.0,
        "text": {"format": {"type": "text"}},
        "usage": {
            "input_tokens": 1,
            "output_tokens": 1,
            "total_tokens": 2,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }
