"""Run inside spawned workers by tests/test_train_knobs.py (importable by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

#: The tiny model of these tests: untied head, GQA, 2 blocks.
MODEL = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64, "ffn_dim": 48, "max_seq_len": 16}
SEQ = 12


def rank_sequences(rank: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` (inputs, targets) sequences of ``rank``, the same in the workers and in the test."""
    g = torch.Generator().manual_seed(7000 + rank)
    tokens = torch.randint(0, MODEL["vocab_size"], (count, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def grad_accum_cases(federated, hsdp, cases, timeout_s):
    """For each case (grad_accum, batch_size, activation_checkpointing, loss_chunk): a fresh
    sharded model, one accumulated step on this rank's sequences, one AdamW step.

    Reports, per case, whether any sharded gradient existed after the first micro-batch's
    backward (it must not: the reduction waits for the last), the full gradients, and the full
    parameters after the step. Also reports the default group's timeout, the state's backend
    and the processes groups' backend string.
    """
    from xffl_like.distributed.layout import plan_layout
    from xffl_like.distributed.state import build_state, init_default_group, read_env
    from xffl_like.models import LlamaConfig, build_model
    from xffl_like.train.optim import OptimConfig, build_optimizer
    from xffl_like.train.parallelize import contiguous_shards, shard_model
    from xffl_like.train.step import TrainConfig, accumulate_gradients

    env = read_env()
    init_default_group(env, "auto")  # as under torchrun: the group exists before the config is known
    state = build_state(plan_layout(env.world_size, federated, hsdp), env, timeout_s=timeout_s)
    default = dist.distributed_c10d._get_default_group()
    out = {
        "timeout_s": default._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
        "backend": state.backend,
        "cases": [],
    }
    ocfg = OptimConfig.from_mapping(
        {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-4}
    )  # a first Adam step is ~lr*sign(g): eps keeps it well-conditioned
    for accum, batch, ac, chunk in cases:
        model = build_model(LlamaConfig.from_mapping(MODEL), seed=3)
        shard_model(model, state)
        contiguous_shards(model, state.shard_size)
        tcfg = TrainConfig.from_mapping(
            {
                "steps": 1,
                "batch_size": batch,
                "seq_len": SEQ,
                "grad_accum": accum,
                "activation_checkpointing": ac,
                "loss_chunk": chunk,
            }
        )
        inputs, targets = rank_sequences(env.rank, accum * batch)
        seen_early_grad = []

        def micro(i, model=model, inputs=inputs, targets=targets, batch=batch, seen_early_grad=seen_early_grad):
            if i == 1:  # the first micro-batch's backward is done: nothing may have been reduced
                seen_early_grad.append(any(p.grad is not None for p in model.parameters()))
            return inputs[i * batch : (i + 1) * batch], targets[i * batch : (i + 1) * batch]

        loss = accumulate_gradients(model, micro, tcfg, state.device)
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        optimizer = build_optimizer(model, ocfg)
        optimizer.step()
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        out["cases"].append(
            {
                "early_grad": bool(seen_early_grad and seen_early_grad[0]),
                "loss": float(loss),
                "grads": grads,
                "params": params,
            }
        )
    dist.destroy_process_group()
    return out


def rope_dtypes(dtype):
    """The dtypes of the hidden state and of the RoPE tables that a block's attention receives, in a
    model sharded for ``train.dtype=dtype`` (one process)."""
    import xffl_like.models.llama as llama
    from xffl_like.distributed.layout import plan_layout
    from xffl_like.distributed.state import build_state, read_env
    from xffl_like.models import LlamaConfig, build_model
    from xffl_like.train.parallelize import shard_model

    env = read_env()
    state = build_state(plan_layout(env.world_size, None, None), env)
    model = shard_model(build_model(LlamaConfig.from_mapping(MODEL), seed=3), state, dtype)
    seen = []
    original = llama.apply_rope

    def recording(x, cos, sin):
        seen.append((str(x.dtype), str(cos.dtype), str(sin.dtype)))
        return original(x, cos, sin)

    llama.apply_rope = recording
    try:
        with torch.no_grad():
            model(rank_sequences(env.rank, 1)[0])
    finally:
        llama.apply_rope = original
    dist.destroy_process_group()
    return sorted(set(seen))
