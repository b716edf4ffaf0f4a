"""A model-harness pair answering: ``Responder`` (one turn, or many tasks as episodes or by a plan), the text its
model reads (``rsi.pair.text``) and the plan runner (``rsi.pair.plans``). The cycle, the proxy, the pyfunc model
and the evaluations all answer through ``Responder``."""

from rsi.pair.responder import Reply, Responder, Run, sampling_params

__all__ = ["Reply", "Responder", "Run", "sampling_params"]
