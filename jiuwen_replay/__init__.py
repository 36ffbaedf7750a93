"""Replaying agent traces against real servers, with and without the hook, and the simulator.

Layout: ``trace`` (the model every format is read into), ``formats`` (readers and writers),
``prompts`` (block ids → chat windows), ``synthetic`` (a small trace made here), ``simulator``
(the offline prefix-cache simulator), ``runner`` (one run against one server), ``compare``
(sides in rounds, summaries, the simulator beside), ``report`` and ``output`` (files), ``cli``
(``jiuwen-bench``, ``python -m jiuwen_replay``). Imports the hook and the plugin's pure core,
never vLLM.
"""
