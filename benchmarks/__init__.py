"""The benchmarks, grouped by the question they answer, each a module run from the repository
root: ``python -m benchmarks.<group>.<name>`` (``make bench`` runs them; results go to
``benchmarks/results/``, whose ``README.md`` lists each one's files, command and doc).

- ``engine``: what the plugin costs vLLM's engine core, and what it holds in memory;
- ``server``: what the plugin costs an API server's requests;
- ``client``: what the hook costs an agent's calls and memory;
- ``agents``: what agents gain, side by side with vanilla vLLM, on real servers and traces;
- ``lifecycle``: how much of the LRU-to-Belady gap idles, predicted returns and the picker
  close, and whether the plugin is ever worse;
- ``hybrid``: what hybrid models (sliding-window, Mamba, linear-attention groups) get;
- ``fleet``: several replicas behind a router (nginx, vllm-router).
"""
