"""What runs inside an LLM engine's process on top of ``dataplane.client``: the reference blended
prefill on transformers (``engine.blend``) and the vLLM integration (``engine.vllm_connector``,
its scheduler side ``engine.vllm_scheduler``, its worker side ``engine.vllm_worker``, the plan
between them ``engine.vllm_plan``, its blend loop ``engine.vllm_blend``, its counters
``engine.vllm_stats`` and the plugin that hands it the worker's model, ``engine.vllm_plugin``).
Never imported by ``api``, ``dataplane`` or ``shm``."""
