"""The API-server process: what runs beside vLLM's OpenAI-compatible server.

``route`` serves ``/release_kv_cache`` and the affinity endpoints and wraps vLLM's serving
classes (``serving``); each request walks ``request_path``'s named steps (the session, the
hints, the compaction rule, implicit sessions, the instructions' end) and the
``release_service`` talks to the engine core through vLLM's utility calls. Prometheus metrics
(``metrics``) and the session lifecycle (``lifecycle``) live here too.

Nothing here imports the engine's modules: what crosses to the engine core goes in a request's
``extra_args`` (``core.request_keys``) or a utility call by name."""
