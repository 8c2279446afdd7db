"""The scheduler's side of the vLLM integration (``growth: "elastic"``), in
the engine core:
:class:`~extensible_kv.integrations.vllm.scheduler.scheduler.ExtensibleKVScheduler`
(``scheduler.py``) and what it plans with: ``plan`` (the units the workers
hold and the orders that change it), ``free_queue`` (vLLM's free-block
queue, packed), ``unit_index`` (the units to look at next), ``in_flight``
(units a running batch may still touch), ``pressure`` (what other processes
on the devices want). It never imports the worker's side."""
