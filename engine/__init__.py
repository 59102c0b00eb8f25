"""What runs inside an LLM engine's process on top of ``dataplane.client``: the reference blended
prefill on transformers (``engine.blend``). Never imported by ``api``, ``dataplane`` or ``shm``."""
