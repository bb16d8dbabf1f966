"""Which parameters of a model get weight decay: the one rule of the project, shared by the main job's
optimizer (:mod:`xffl_like.train.optim`) and the data-parallel library's factories (:mod:`xffl_like.parallel`)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

__all__ = ["decay_groups"]

_EMBEDDING_NAMES = ("wte", "wpe")  # GPT-2's embedding modules, whose names do not say "embed"


def decay_groups(
    params: nn.Module | Iterable[tuple[str, Tensor]], decay_all: bool = False
) -> tuple[list[str], list[str]]:
    """Names of the parameters that get weight decay, and of those that do not: the one rule of
    the project, used by the main job's optimizer and by the ``xffl_like.parallel`` factories.

    ``params`` is a module or ``(name, parameter)`` pairs (what DecentralizedDataParallel
    passes to its ``optim_fn``, one bucket at a time). Without ``decay_all``, biases and norm
    gains (every parameter with fewer than 2 dimensions) and embedding tables get none:
    shrinking a norm's gain or a rare token's row towards zero is not regularisation. A
    module's embeddings are its ``nn.Embedding`` weights (so also a head tied to one); in
    pairs, a parameter whose module name contains ``embed`` (``tok_embeddings``,
    ``embed_tokens``, ``word_embeddings``) or is ``wte``/``wpe``. Each shared parameter is
    listed once, under its first name. ``decay_all``: every parameter decays.
    """
    embeddings: set[int] = set()
    if isinstance(params, nn.Module):
        embeddings = {id(m.weight) for m in params.modules() if isinstance(m, nn.Embedding)}
        params = params.named_parameters()

    def exempt(name: str, param: Tensor) -> bool:
        module = name.rsplit(".", 1)[0].split(".")[-1].lower() if "." in name else ""
        return param.ndim < 2 or id(param) in embeddings or "embed" in module or module in _EMBEDDING_NAMES

    decay, no_decay, seen = [], [], set()
    for name, param in params:
        if id(param) in seen:
            continue
        seen.add(id(param))
        (no_decay if not decay_all and exempt(name, param) else decay).append(name)
    return decay, no_decay
