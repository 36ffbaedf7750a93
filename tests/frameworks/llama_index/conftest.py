"""llama-index pins ``openai<3``, which cannot share the main environment (openai 3 for
openai-agents and vLLM). ``make test`` runs this folder in its own virtualenv
(``.venv-llamaindex``, which also exercises the hook on openai 2) with
``JIUWEN_LLAMA_INDEX_VENV=1``; everywhere else it is not collected."""

from __future__ import annotations

import os

if os.environ.get("JIUWEN_LLAMA_INDEX_VENV") != "1":
    collect_ignore = ["test_llama_index.py"]
