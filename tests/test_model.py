"""Tests for the native Llama model (CPU only, fast)."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import load_model_conf as load
from omegaconf import OmegaConf

from xffl_like.models import Llama, LlamaConfig, build_model
from xffl_like.models.llama import count_parameters

CONF = Path(__file__).parents[1] / "conf" / "model"


def tiny(**over):
    m = OmegaConf.to_container(load("llama_tiny"))
    m.update(over)
    return m


@pytest.mark.parametrize(
    "name, published",
    [
        ("llama3_2_1b", 1_235_814_400),
        ("llama3_1_8b", 8_030_261_248),
        ("llama3_1_70b", 70_553_706_496),
    ],
)
def test_real_shapes_param_count(name, published):
    """The published counts are exact integers: the shapes must give exactly them."""
    cfg = load(name)
    model = build_model(LlamaConfig.from_mapping(cfg), device="meta")
    assert model.tok_embeddings.weight.is_meta
    assert count_parameters(model) == published
    # The same count by hand from the config: embeddings, per layer (q, k, v, o; the
    # SwiGLU's three matrices; two RMSNorms), the final norm, the output unless tied.
    d, hd = cfg.dim, cfg.dim // cfg.n_heads
    layer = d * cfg.n_heads * hd + 2 * d * cfg.n_kv_heads * hd + cfg.n_heads * hd * d + 3 * d * cfg.ffn_dim + 2 * d
    by_hand = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2) + cfg.n_layers * layer + d
    assert by_hand == published


def test_all_yamls_load():
    for path in sorted(CONF.glob("*.yaml")):
        if path.stem == "hf":  # the shape comes from the HF directory's config.json
            continue
        cfg = LlamaConfig.from_mapping(OmegaConf.load(path))
        assert cfg.dim % cfg.n_heads == 0
    assert count_parameters(build_model(LlamaConfig.from_mapping(load("llama_bench")), device="meta")) == 58_466_816


def test_forward_shape_and_causal():
    model = build_model(LlamaConfig.from_mapping(load("llama_tiny")), seed=0)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 32, 256) and logits.dtype == torch.float32
    changed = tokens.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    logits2 = model(changed)
    assert torch.equal(logits[:, :20], logits2[:, :20])
    assert not torch.allclose(logits[:, 20:], logits2[:, 20:])


def test_tied_vs_untied_param_count():
    untied = build_model(LlamaConfig.from_mapping(tiny(tie_embeddings=False)), device="meta")
    tied = build_model(LlamaConfig.from_mapping(tiny(tie_embeddings=True)), device="meta")
    assert tied.output is None and isinstance(untied.output, torch.nn.Linear)
    assert count_parameters(untied) - count_parameters(tied) == 256 * 128
    model = build_model(LlamaConfig.from_mapping(tiny(tie_embeddings=True)))
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 256)


def test_init_determinism():
    a, b = (
        build_model(LlamaConfig.from_mapping(load("llama_tiny")), seed=123),
        build_model(LlamaConfig.from_mapping(load("llama_tiny")), seed=123),
    )
    c = build_model(LlamaConfig.from_mapping(load("llama_tiny")), seed=124)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() and "rope_cos" not in sa  # rope buffers are not persistent
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])
    # residual projections get the smaller, depth-scaled std
    assert sa["layers.0.attention.wo.weight"].std() < 0.5 * sa["layers.0.attention.wq.weight"].std()
    assert torch.equal(sa["norm.weight"], torch.ones(128))


def test_training_reduces_loss():
    torch.manual_seed(0)
    model = build_model(LlamaConfig.from_mapping(load("llama_tiny")), seed=0)
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - torch.log(torch.tensor(256.0)).item()) < 0.5  # starts near uniform
    assert losses[-1] < losses[0] - 0.5


def test_bf16_forward():
    model = build_model(LlamaConfig.from_mapping(load("llama_tiny")), dtype=torch.bfloat16)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16 and model.rope_cos.dtype == torch.float32
    logits = model(torch.randint(0, 256, (2, 16)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_meta_to_empty_matches_direct_init():
    direct = build_model(LlamaConfig.from_mapping(load("llama_tiny")), seed=7)
    meta = build_model(LlamaConfig.from_mapping(load("llama_tiny")), device="meta")
    meta.to_empty(device="cpu")
    meta.init_weights(seed=7)
    sd, sm = direct.state_dict(), meta.state_dict()
    assert all(torch.equal(sd[k], sm[k]) for k in sd)
    assert torch.equal(direct.rope_cos, meta.rope_cos) and torch.equal(direct.rope_sin, meta.rope_sin)
    tokens = torch.randint(0, 256, (1, 16))
    assert torch.equal(direct(tokens), meta(tokens))


def test_too_long_sequence_raises():
    model = build_model(LlamaConfig.from_mapping(tiny(max_seq_len=8)))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    "over, key",
    [
        ({"dim": -1}, "dim"),
        ({"n_layers": 0}, "n_layers"),
        ({"vocab_size": 2.5}, "vocab_size"),
        ({"n_heads": 3}, "n_heads"),  # 128 % 3 != 0
        ({"n_kv_heads": 3}, "n_kv_heads"),  # 4 % 3 != 0
        ({"dim": 132, "n_heads": 4, "n_kv_heads": 4}, "head_dim"),  # 33 is odd
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_config_raises(over, key):
    with pytest.raises(ValueError, match=key):
        LlamaConfig.from_mapping(tiny(**over))


def test_missing_key_raises():
    m = tiny()
    del m["ffn_dim"]
    with pytest.raises(ValueError, match="ffn_dim"):
        LlamaConfig.from_mapping(m)


def test_llama_direct_construction():
    model = Llama(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=50, ffn_dim=128))
    model.init_weights(0)
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 50)


def test_block_init_is_the_documented_scheme_for_any_cut(monkeypatch):
    """Rows [lo, hi) of a parameter are the rows of blocks drawn whole from (seed, name, block)
    generators, whatever [lo, hi): the reason a sharded meta init equals the full one."""
    from xffl_like.models import llama

    monkeypatch.setattr(llama, "INIT_BLOCK_ELEMENTS", 1000)  # 15 rows of 64 per block
    blocks = []
    for b in range(4):  # by hand: 50 rows = blocks of 15, 15, 15, 5
        gen = torch.Generator().manual_seed(llama._block_seed(7, "w", b))
        blocks.append(torch.empty(min(15, 50 - 15 * b), 64).normal_(0.0, 0.02, generator=gen))
    full = torch.cat(blocks)
    rows = llama._block_normal(7, "w", 0.02, torch.Size([50, 64]))
    for lo, hi in [(0, 50), (0, 13), (13, 37), (37, 50), (14, 16), (20, 20)]:
        got = list(rows((64,), lo, hi))
        assert torch.equal(torch.cat(got) if got else torch.empty(0, 64), full[lo:hi]), (lo, hi)
