"""Hugging Face import/export against transformers itself (the reference), in process and as jobs.

A tiny ``LlamaForCausalLM`` (GQA, llama3 RoPE scaling, tied or untied) is built from a
``LlamaConfig`` here and saved with ``save_pretrained``; nothing is downloaded.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from helpers import run_cli  # noqa: E402

from xffl_like.checkpoint.hf import (  # noqa: E402
    check_hf_weights,
    from_hf_layout,
    load_hf_weights,
    read_hf_config,
    to_hf_layout,
)
from xffl_like.models import LlamaConfig, build_model  # noqa: E402

ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def save_tiny_hf(directory, *, tied: bool, seed: int = 0, heads: int = 4, kv_heads: int = 2, **over):
    """A random tiny LlamaForCausalLM saved with save_pretrained; returns the transformers model."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(ROPE),
        tie_word_embeddings=tied,
        **over,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1 so that a swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_match_transformers(tmp_path, tied):
    reference = save_tiny_hf(tmp_path, tied=tied)
    shape = read_hf_config(tmp_path)
    assert shape["rope_scaling"]["factor"] == 8.0 and shape["n_kv_heads"] == 2 and shape["tie_embeddings"] is tied
    ours = build_model(LlamaConfig.from_mapping(shape), device="meta")
    ours.to_empty(device="cpu")
    load_hf_weights(ours, tmp_path)
    tokens = torch.randint(0, 300, (2, 100), generator=torch.Generator().manual_seed(1))  # beyond 16: scaling matters
    with torch.no_grad():
        diff = (reference(tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= 1e-4, diff


def test_transformers4_config_spelling(tmp_path):
    """transformers 4 writes rope_theta + rope_scaling instead of rope_parameters: same shape."""
    save_tiny_hf(tmp_path, tied=False)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}
    v5 = read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_hf_config(tmp_path) == v5


def test_rope_layout_permutation_roundtrip():
    w = torch.arange(4 * 16 * 3, dtype=torch.float32).reshape(64, 3)
    assert torch.equal(from_hf_layout(to_hf_layout(w, 4), 4), w)
    # head 0 of HF's layout: first half of the pairs' first components, then the second components
    assert torch.equal(to_hf_layout(w, 4)[:8], w[0:16:2])


def test_header_checks(tmp_path):
    save_tiny_hf(tmp_path, tied=False)
    shape = read_hf_config(tmp_path)
    check_hf_weights(tmp_path, LlamaConfig(**shape))
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight has shape \[300, 64\]"):
        check_hf_weights(tmp_path, LlamaConfig(**{**shape, "vocab_size": 301}))
    with pytest.raises(ValueError, match="model.layers.2.input_layernorm.weight is missing"):
        check_hf_weights(tmp_path, LlamaConfig(**{**shape, "n_layers": 3}))


def _load_exported(run_dir):
    logger = transformers.utils.logging.get_logger("transformers.modeling_utils")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf", output_loading_info=True)
    finally:
        logger.removeHandler(handler)
    assert not any(info.values()), info
    assert not [r for r in records if "key" in r.getMessage().lower()], [r.getMessage() for r in records]
    return model


def _assert_bitwise(source, exported):
    a, b = source.state_dict(), exported.state_dict()
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different


JOB = ["train.steps=0", "export.hf=true", "logger=none", "train.seq_len=32", "train.batch_size=2"]


@pytest.mark.cli
@pytest.mark.slow
def test_job_exports_bitwise_fsdp_sharded_files(tmp_path):
    """2 facilities x FSDP over 2 ranks; n_kv_heads=1: each rank's k rows cut a head in half.
    A 60 kB file limit forces a sharded export with an index."""
    source = save_tiny_hf(tmp_path / "src", tied=False, heads=2, kv_heads=1)
    run = tmp_path / "run"
    proc, _ = run_cli(
        ["+experiment=llama_fed", "model=hf", f"model.path={tmp_path / 'src'}", *JOB, "export.max_shard_mb=0.06"], run
    )
    assert proc.returncode == 0, proc.stderr
    index = json.loads((run / "hf" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((run / "hf" / f).exists() for f in files)
    _assert_bitwise(source, _load_exported(run))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["first_loss"] is None and summary["setup_peak_rss_mb"] > 0


@pytest.mark.cli
@pytest.mark.slow
def test_job_exports_bitwise_hsdp_tied(tmp_path):
    """Facilities of 4 and 2 ranks, HSDP shards of 2 (facility 0: 2 replicas), tied embeddings."""
    source = save_tiny_hf(tmp_path / "src", tied=True, seed=3)
    run = tmp_path / "run"
    proc, _ = run_cli(
        [
            "+experiment=llama_fed",
            "model=hf",
            f"model.path={tmp_path / 'src'}",
            *JOB,
            "distributed.nproc_per_node=6",
            "distributed.federated=[4,2]",
            "distributed.hsdp=2",
        ],
        run,
    )
    assert proc.returncode == 0, proc.stderr
    assert (run / "hf" / "model.safetensors").exists() and not (run / "hf" / "model.safetensors.index.json").exists()
    exported = _load_exported(run)
    _assert_bitwise(source, exported)
    assert exported.config.tie_word_embeddings and exported.config.rope_parameters["rope_type"] == "llama3"


@pytest.mark.cli
@pytest.mark.slow
def test_meta_init_under_hsdp_equals_the_unsharded_init(tmp_path):
    """model.init=meta, facilities [4, 2] with HSDP shards of 2: every rank draws only its rows,
    yet the exported model is the one built whole in this process from the same seed."""
    run = tmp_path / "run"
    proc, _ = run_cli(
        [
            "+experiment=llama_fed",
            "model.init=meta",
            "seed=5",
            *JOB,
            "distributed.nproc_per_node=6",
            "distributed.federated=[4,2]",
            "distributed.hsdp=2",
        ],
        run,
    )
    assert proc.returncode == 0, proc.stderr
    exported = _load_exported(run).eval()
    from helpers import load_model_conf as load
    from omegaconf import OmegaConf

    whole = build_model(
        LlamaConfig.from_mapping(OmegaConf.to_container(load("llama_tiny"))), seed=5
    )  # unsharded, model.init=full
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(exported(tokens).logits, whole(tokens), atol=1e-5, rtol=0)
    assert exported.model.norm.weight.eq(1).all()
