"""vLLM's general plugin of kvblend: hands each worker's model to the kvblend connector.

vLLM gives a KV connector its attention layers' caches only; blending (computing the tokens no
stored chunk covers, and recomputing the selected rows) needs the model's own modules. vLLM loads
every entry point of the group ``vllm.general_plugins`` in each of its processes before it builds
a worker; kvblend's (``register``, declared in pyproject.toml) wraps the model loaders' ``load_model``
so the model a worker loads is remembered here, beside the model config it was loaded for, and
the connector's worker side (``engine.vllm_worker``) takes it by that config (``model_for``): a
draft model of speculative decoding, loaded for another config, is never taken for the target.
vLLM itself is not patched: the wrapper calls the loader it replaces and returns its model
unchanged.

This module owns that record only; it imports vLLM's loader module, nothing of the worker.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

log = logging.getLogger("kvblend.vllm")

_models: list[tuple[Any, weakref.ReferenceType]] = []  # (model config, model) in load order
_MARK = "_kvblend_wrapped"


def register() -> None:
    """The entry point: wrap ``load_model`` of vLLM's base model loader and of every loader
    class that overrides it (those imported by now), and let a config name the connector by its
    old module name (``engine.legacy``). Idempotent."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from kvblend.engine import legacy
    legacy.install()
    for cls in [BaseModelLoader, *_subclasses(BaseModelLoader)]:
        own = cls.__dict__.get("load_model")
        if own is not None and not getattr(own, _MARK, False):
            cls.load_model = _wrap(own)  # type: ignore[method-assign]


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _wrap(load: Any) -> Any:
    @functools.wraps(load)
    def load_model(self: Any, vllm_config: Any, model_config: Any, *args: Any, **kwargs: Any
                   ) -> Any:
        model = load(self, vllm_config, model_config, *args, **kwargs)
        _models[:] = [(c, m) for c, m in _models if m() is not None]
        _models.append((model_config, weakref.ref(model)))
        return model
    setattr(load_model, _MARK, True)
    return load_model


def model_for(model_config: Any) -> Any:
    """The model this process loaded last for ``model_config`` (that very object), or None where
    the plugin was not loaded (``VLLM_PLUGINS`` leaves it out, kvblend not installed as a
    distribution) or no model was loaded yet."""
    live = [(config, ref()) for config, ref in _models if ref() is not None]
    for config, model in reversed(live):
        if config is model_config:
            return model
    for config, model in live:  # a copy of the config: the first model loaded for that path
        if getattr(config, "model", None) == getattr(model_config, "model", ""):
            return model
    return None


__all__ = ["model_for", "register"]
