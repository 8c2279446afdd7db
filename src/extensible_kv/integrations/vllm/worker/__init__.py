"""The worker's side of the vLLM integration, in each worker process:
:class:`~extensible_kv.integrations.vllm.worker.worker.ExtensibleKVWorker`
(``worker.py``) owns the KV cache; each idea's rules live in a module beside
it: ``sizing`` (capacity, the measure after warm-up), ``handover`` (vLLM's
allocation becomes the reservation), ``commit`` (what is committed, by
growth mode), ``connectors``, ``sleep`` (sleep, wake, trim), ``elastic`` (the
scheduler's orders, step by step), ``steps`` (what a step says about
blocks), ``budget`` (this rank's floor and cap), ``state`` (the figures
``extensible_kv_state`` reports). It never imports the scheduler's side."""
