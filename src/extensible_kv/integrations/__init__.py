"""Integrations with libraries users already run; each is an optional extra.

- :mod:`extensible_kv.integrations.transformers`: a Hugging Face
  ``transformers`` cache (``pip install 'extensible-kv[transformers]'``).
"""
